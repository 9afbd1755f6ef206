#!/usr/bin/env bash
# End to end on a throwaway kind cluster: image -> CRD + operator -> InferenceService with a tiny
# model -> Ready -> a chat completion through the router Service -> a burst scales the pool up and
# it scales back -> delete cleans up every child. Needs docker, kind and kubectl; ~10 minutes.
#   e2e/kind.sh            (KEEP=1 keeps the cluster afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-pagefleet-e2e}
NS=e2e
step() { printf '\n=== %s (%ss)\n' "$*" "$SECONDS"; }
cleanup() { if [ -z "${KEEP:-}" ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
# wait_replicas OP N MESSAGE: poll the engine Deployment's replicas (5 min) until `[ replicas OP N ]`
wait_replicas() {
  local replicas
  for _ in $(seq 60); do
    replicas=$(kubectl -n "$NS" get deployment tiny-main -o jsonpath='{.spec.replicas}')
    [ "$replicas" "$1" "$2" ] && { echo "engine replicas: $replicas"; return 0; }
    sleep 5
  done
  echo "$3 (replicas: $replicas)" >&2
  exit 1
}

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "e2e needs $tool on PATH" >&2; exit 2; }
done

step "cluster"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s

step "image"
docker build -t pagefleet:e2e .
kind load docker-image pagefleet:e2e --name "$CLUSTER"

step "CRD and operator"
kubectl apply -f crds/inferenceservice.yaml
kubectl wait --for=condition=Established crd/inferenceservices.pagefleet.dev --timeout=60s
sed 's#ghcr.io/pagefleet/pagefleet:0.1.0#pagefleet:e2e#; s#imagePullPolicy: IfNotPresent#imagePullPolicy: Never#' \
  manifests/operator.yaml | kubectl apply -f -
kubectl -n pagefleet-system set env deployment/pagefleet-operator PAGEFLEET_AUTOSCALE_INTERVAL=5
kubectl -n pagefleet-system rollout status deployment/pagefleet-operator --timeout=180s

step "tiny model"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$NS" apply -f e2e/tiny-model.yaml
kubectl -n "$NS" wait --for=condition=complete job/make-tiny-model --timeout=300s

step "InferenceService"
kubectl -n "$NS" apply -f e2e/tiny-isvc.yaml
kubectl -n "$NS" wait --for=condition=Ready inferenceservice/tiny --timeout=600s
kubectl -n "$NS" get pfis tiny

step "chat completion through the router Service"
kubectl -n "$NS" run client --rm -i --restart=Never --image=pagefleet:e2e --image-pull-policy=Never \
  --command -- python -c '
import httpx
r = httpx.post("http://tiny/v1/chat/completions", timeout=120,
               json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
print(r.status_code, r.text)
assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8'

step "burst: the pool scales up"
kubectl -n "$NS" run load --restart=Never --image=pagefleet:e2e --image-pull-policy=Never --command -- python -c '
import concurrent.futures, httpx
def one(i):
    return httpx.post("http://tiny/v1/completions", timeout=600, json={"model": "tiny", "prompt": f"load {i}",
                      "max_tokens": 400, "ignore_eos": True}).status_code
with concurrent.futures.ThreadPoolExecutor(16) as ex:
    codes = list(ex.map(one, range(48)))
print(codes); assert codes == [200] * 48'
wait_replicas -gt 1 "the pool did not scale up"
kubectl -n "$NS" get pfis tiny -o jsonpath='{.status.pools.main.lastScaling}'; echo
kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Succeeded pod/load --timeout=900s

step "after the window: the pool scales back"
wait_replicas -eq 1 "the pool did not scale back down"

step "delete: children go with it"
kubectl -n "$NS" delete inferenceservice tiny --wait --timeout=120s
for _ in $(seq 30); do
  left=$(kubectl -n "$NS" get deployments,services,configmaps,serviceaccounts,roles,rolebindings \
         -l app.kubernetes.io/instance=tiny -o name | wc -l)
  [ "$left" -eq 0 ] && break
  sleep 2
done
[ "$left" -eq 0 ] || { echo "$left children left behind" >&2; exit 1; }
step "passed"
