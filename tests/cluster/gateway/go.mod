module understudy.dev/cluster-tier/gateway

go 1.26.0

// The Gateway API and Inference Extension CRDs the cluster tier installs, read from these
// modules' config/crd folders (gateway-crds.sh), and Traefik, the Gateway API implementation it
// fails over through, built from its own module with its own go.mod and go.sum (traefik.sh).
// Traefik v3.6.12, since v3.7's dependencies include modules the Go module proxy does not serve,
// and the Gateway API v1.4 it speaks.
require (
	github.com/traefik/traefik/v3 v3.6.12
	sigs.k8s.io/gateway-api v1.4.1
	sigs.k8s.io/gateway-api-inference-extension v1.0.2
)
