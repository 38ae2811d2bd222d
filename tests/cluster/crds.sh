#!/usr/bin/env bash
# The CRDs against a real kube-apiserver: crds/ is applied and established, every example
# policy and GameDay is admitted (server-side dry run), and every file in examples/invalid/ is
# refused with the field and the message its `# expect:` line names. The mock API server and
# kube-cel check the same rules in `cargo test`; this is the server that users run.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
run=$("$root/tests/cluster/up.sh")
trap '"$root/tests/cluster/down.sh" "$run"' EXIT
bin=$("$root/tests/cluster/build.sh")
k() { "$bin/kubectl" --kubeconfig "$run/kubeconfig" "$@"; }

k apply -f "$root/crds/" >/dev/null
k wait --for=condition=Established crd --all --timeout=60s >/dev/null
for ns in $(grep -h '^  namespace:' "$root"/examples/*.yaml "$root"/examples/invalid/*.yaml | awk '{print $2}' | sort -u); do
  k create namespace "$ns" >/dev/null
done

failed=0
for f in "$root"/examples/*.yaml; do
  if ! out=$(k apply --dry-run=server -f "$f" 2>&1); then
    echo "crds.sh: ${f#"$root"/} was refused by kube-apiserver:" >&2
    printf '%s\n' "$out" >&2
    failed=1
  fi
done
checked=0
for f in "$root"/examples/invalid/*.yaml; do
  expect=$(head -1 "$f" | sed -n 's/^# expect: //p')
  [ -n "$expect" ] || { echo "crds.sh: ${f#"$root"/} has no '# expect:' first line" >&2; failed=1; continue; }
  # kube-apiserver writes `FIELD: Invalid value: VALUE: MESSAGE`; the expectation is
  # `FIELD: MESSAGE`, so each half must be in the answer.
  field=${expect%%: *}
  message=${expect#*: }
  if out=$(k apply --dry-run=server -f "$f" 2>&1); then
    echo "crds.sh: ${f#"$root"/} was admitted by kube-apiserver" >&2
    failed=1
  elif ! grep -qF -- "$field" <<<"$out" || ! grep -qF -- "$message" <<<"$out"; then
    echo "crds.sh: ${f#"$root"/}: expected \"$expect\", kube-apiserver said:" >&2
    printf '%s\n' "$out" >&2
    failed=1
  fi
  checked=$((checked + 1))
done
[ "$failed" = 0 ] || exit 1
echo "kube-apiserver admitted every example and refused all $checked invalid ones with their messages"
