#!/usr/bin/env bash
# The manifests of deploy/kubernetes/ validate against Kubernetes' own schemas (strict: no
# unknown field), and fit together: the nodes' termination grace period is above their drain
# deadline, and the StatefulSet, its Service and its PodDisruptionBudget select the same pods.
# Uses the tests' own venv with kubernetes-validate (tools/setup.sh makes it).
set -euo pipefail
dir=$1
venv=${TROUPE_K8S_VENV:-/opt/troupe-k8s-venv}
k8s_version=1.29.0  # shipped by the pinned kubernetes-validate (tools/setup.sh)
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "skipped: $venv/bin/kubernetes-validate is missing (tools/setup.sh installs it)"
  exit 77
fi
shopt -s nullglob
manifests=("$dir"/*.yaml "$dir"/*.yml)
[ ${#manifests[@]} -gt 0 ] || { echo "no manifest in $dir"; exit 1; }

# kubernetes-validate exits 0 on a kind it has no schema for (WARN): count that as a failure.
out=$("$venv/bin/kubernetes-validate" --strict --quiet -k "$k8s_version" "${manifests[@]}" 2>&1) \
  && rc=0 || rc=$?
if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
  echo "$out"
  echo "kubernetes-validate $k8s_version --strict failed (exit $rc)"
  exit 1
fi

"$venv/bin/python" - "$k8s_version" "${manifests[@]}" <<'PY'
import sys, yaml

docs = []
for f in sys.argv[2:]:
    with open(f) as fh:
        docs += [d for d in yaml.safe_load_all(fh) if d]

def one(kind):
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        sys.exit(f"expected one {kind}, found {len(found)}")
    return found[0]

errors = []
sts, svc, pdb = one("StatefulSet"), one("Service"), one("PodDisruptionBudget")
pod = sts["spec"]["template"]
labels = pod["metadata"].get("labels", {})
subset = lambda sel: bool(sel) and all(labels.get(k) == v for k, v in sel.items())

# Grace period above the drain deadline, or the kubelet SIGKILLs a node still draining.
grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
node = pod["spec"]["containers"][0]
cmd = node.get("command", []) + node.get("args", [])
if "--drain-timeout-ms" in cmd:
    drain_ms = int(cmd[cmd.index("--drain-timeout-ms") + 1])
else:
    drain_ms = 30000  # the nodes' default
if grace * 1000 <= drain_ms:
    errors.append(f"terminationGracePeriodSeconds {grace} s is not above --drain-timeout-ms {drain_ms} ms")

# One set of pods: the StatefulSet's, its Service's and its PDB's selectors all pick them.
if not subset(sts["spec"]["selector"].get("matchLabels")) or sts["spec"]["selector"].get("matchExpressions"):
    errors.append("StatefulSet selector does not match its pod labels (matchLabels only)")
if sts["spec"].get("serviceName") != svc["metadata"]["name"]:
    errors.append(f"StatefulSet serviceName is not the Service {svc['metadata']['name']}")
if not subset(svc["spec"].get("selector")):
    errors.append("Service selector does not match the StatefulSet's pod labels")
if svc["spec"].get("clusterIP") != "None":
    errors.append("Service is not headless (clusterIP: None)")
psel = pdb["spec"]["selector"]
if not subset(psel.get("matchLabels")) or psel.get("matchExpressions"):
    errors.append("PodDisruptionBudget selector does not match the StatefulSet's pod labels")
if psel.get("matchLabels") != svc["spec"].get("selector"):
    errors.append("PodDisruptionBudget selector differs from the Service's selector")
# No other pod (the coordinator) may be in the nodes' DNS name.
for d in docs:
    if d.get("kind") in ("Job", "Deployment", "DaemonSet") or (d.get("kind") == "StatefulSet" and d is not sts):
        other = d["spec"]["template"]["metadata"].get("labels", {})
        if all(other.get(k) == v for k, v in svc["spec"]["selector"].items()):
            errors.append(f"{d['kind']} {d['metadata']['name']} pods match the nodes' Service selector")
# Every Service port reaches a named container port.
names = {p.get("name") for p in node.get("ports", [])}
for p in svc["spec"]["ports"]:
    if isinstance(p.get("targetPort"), str) and p["targetPort"] not in names:
        errors.append(f"Service port {p['name']}: no container port named {p['targetPort']}")

if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"kubernetes-validate --strict {sys.argv[1]}: {len(sys.argv) - 2} manifests clean; "
      f"terminationGracePeriodSeconds {grace} s > drain {drain_ms} ms; selectors agree")
PY
