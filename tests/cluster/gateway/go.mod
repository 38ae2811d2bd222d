module understudy.dev/cluster-tier/gateway

go 1.26.0

// The Gateway API and Inference Extension CRDs the cluster tier installs, read from these
// modules' config/crd folders (gateway-crds.sh); nothing here is built.
require (
	sigs.k8s.io/gateway-api v1.6.3
	sigs.k8s.io/gateway-api-inference-extension v1.0.2
)
