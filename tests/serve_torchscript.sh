#!/usr/bin/env bash
# serve --model FILE.pt (or FILE.pt2 with a third argument pt2: the same model through
# torch.export and AOTInductor): a small ResNet-style CNN exported from Python at test time
# (examples/export_model.py, with the project's venv), served by 2 CPU producers that share one
# loaded copy (device_state) and warm it up; the reference rows Python computed must come back
# from the C++ side, and every one of the self-test's answers is checked. Then as a client sees
# it: requests of a wrong shape, sent at once with right ones (one batch), get a 400 with the
# model's own message while the right ones are answered; the server goes on, and SIGTERM ends it.
set -euo pipefail
serve=$1
exporter=$2
ext=${3:-pt}
python=${TROUPE_VENV:-/opt/troupe-venv}/bin/python
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "skipped: no torch in $python (tools/setup.sh installs it)"
  exit 77
fi
dir=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
source "$(dirname "$0")/serve_lib.sh"
model=$dir/tiny.$ext
"$python" "$exporter" "$model" --width 8 --references 8
"$serve" --listen 127.0.0.1:0 --devices cpu,cpu --model "$model" --requests 300 \
  --concurrency 16 --max-batch 16 --max-delay-us 500 > "$dir/out" 2> "$dir/err" ||
  { cat "$dir/err"; exit 1; }
cat "$dir/err" "$dir/out"
grep -q "reference: $model gives Python's scores on 8 rows" "$dir/err"
grep -q "model loaded 1 time(s)" "$dir/err"
grep -q "0 wrong" "$dir/err"
grep -Eq "^result: [0-9]+$" "$dir/out"
echo "$model served: ok"

start "$serve" --listen 127.0.0.1:0 --devices cpu,cpu --model "$model" --max-batch 16 \
  --max-delay-us 200000
python3 - "$port" <<'PY'
import http.client, json, sys, threading
port = int(sys.argv[1])
def call(body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/predict", body=body)
    r = c.getresponse()
    return r.status, r.read().decode()
right = ",".join(str(i / 10) for i in range(16))
wrong = [",".join(str(i / 10) for i in range(n)) for n in (15, 17, 3)]
bodies = [right] * 6 + wrong
answers = [None] * len(bodies)
def go(i):
    answers[i] = call(bodies[i])
threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
for t in threads: t.start()
for t in threads: t.join()
for (status, body), b in zip(answers, bodies):
    if b == right:
        assert status == 200 and '"class": ' in body, (status, body)
    else:
        assert status == 400, (status, body)
        error = json.loads(body)["error"]
        assert error.startswith("the model refused the input: "), error
        assert len(error) > len("the model refused the input: ") + 10, error  # the model's words
print("wrong shapes:", [json.loads(a[1])["error"][:120] for a in answers[6:]])
status, body = call(right)
assert status == 200, (status, body)  # and it goes on
# A flood of refused requests takes no producer out (no quarantine by default).
flood = [None] * 40
def bad(i):
    flood[i] = call(wrong[i % 3])[0]
threads = [threading.Thread(target=bad, args=(i,)) for i in range(len(flood))]
for t in threads: t.start()
for t in threads: t.join()
assert flood == [400] * len(flood), flood
status, body = call(right)
assert status == 200, (status, body)
PY
stop
echo "wrong shapes refused with the model's message, the others answered: ok"

[ "$ext" = pt ] || exit 0
# The file rewritten in place (as cp does) while serve runs: every load reads serve's own copy,
# so the self-test's scores, computed after its requests, are those of the model it served.
# Before, they came from the new file: most answers counted wrong.
"$python" "$exporter" "$dir/other.pt" --width 8 --references 8 --seed 1
mkdir "$dir/tmp"
TMPDIR=$dir/tmp "$serve" --listen 127.0.0.1:0 --devices cpu,cpu --model "$model" --requests 20 \
  --concurrency 1 --max-batch 16 --max-delay-us 200000 > "$dir/out2" 2> "$dir/err2" &
spid=$!
for _ in $(seq 1 1200); do grep -q "serving HTTP" "$dir/err2" && break; sleep 0.05; done
cp "$dir/other.pt" "$model"
cp "$dir/other.pt.ref.txt" "$model.ref.txt"
wait "$spid" || { cat "$dir/err2"; exit 1; }
grep -q " 0 wrong" "$dir/err2" || { echo "the model rewritten while served:"; cat "$dir/err2"; exit 1; }
[ -z "$(ls -A "$dir/tmp")" ] || { echo "serve left its copy of the model behind"; exit 1; }
echo "the model rewritten while served: the self-test checked the version served: ok"
# SIGTERM while serve starts (its copy of the model made, the model not loaded yet) ends it once
# it serves, and its copy goes (the default action ended it where it was, the copy left behind);
# a copy that a killed serve left (its process gone) is removed by the next one.
sleep 0 &
gone=$!
wait "$gone"
mkdir "$dir/tmp/troupe-serve-$gone-stale1"
TMPDIR=$dir/tmp "$serve" --listen 127.0.0.1:0 --devices cpu,cpu --model "$model" \
  > "$dir/out3" 2> "$dir/err3" &
spid=$!
for _ in $(seq 1 1200); do
  [ -n "$(ls "$dir/tmp" | grep -v stale1)" ] && break
  sleep 0.01
done
[ ! -e "$dir/tmp/troupe-serve-$gone-stale1" ] || { echo "a dead serve's copy was left"; exit 1; }
kill -TERM "$spid"
rc=0
wait "$spid" || rc=$?
[ "$rc" -eq 0 ] && grep -q "^result: 0 requests served" "$dir/out3" ||
  { echo "SIGTERM while serve started (rc $rc):"; cat "$dir/err3" "$dir/out3"; exit 1; }
[ -z "$(ls -A "$dir/tmp")" ] || { echo "SIGTERM while serve started left:"; ls "$dir/tmp"; exit 1; }
echo "SIGTERM while serve starts: it stops once it serves, its copy removed; a dead one's too: ok"
# A model file left empty (as cp leaves it while it rewrites it) counts as one being rewritten:
# copied again, then refused with a clear message, and no copy left behind.
: > "$dir/empty.pt"
rc=0
TMPDIR=$dir/tmp "$serve" --listen 127.0.0.1:0 --devices cpu --model "$dir/empty.pt" --requests 5 \
  2> "$dir/erre" || rc=$?
[ "$rc" -ne 0 ] && grep -q "empty.pt kept changing (or stayed empty) while serve read it" "$dir/erre" ||
  { echo "an empty model (rc $rc):"; cat "$dir/erre"; exit 1; }
[ -z "$(ls -A "$dir/tmp")" ] || { echo "an empty model left:"; ls "$dir/tmp"; exit 1; }
echo "an empty model: refused as one being rewritten: ok"
# Models of another task, as users export them by mistake: one answers 3 columns, not 10 (its
# answers were read past their end, the self-test's reference too); one raises in TorchScript
# for a width other than 16 (a JITException, not a c10::Error: a 500 with its traceback before,
# and its warm-up at a size it refuses stopped the server).
cat > "$dir/models.py" <<'PY'  # TorchScript reads the module's source: a file, not stdin
import sys, torch
class ThreeColumns(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3]
class Picky(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) != 16:
            raise ValueError("expected 16 features")
        assert x.size(0) <= 4, "at most 4 rows per call"
        return x[:, :10]
class Flat(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1)
torch.jit.script(ThreeColumns()).save(sys.argv[1] + "/three.pt")
torch.jit.script(Flat()).save(sys.argv[1] + "/flat.pt")
torch.jit.script(Picky()).save(sys.argv[1] + "/picky.pt")
with open(sys.argv[1] + "/three.pt.ref.txt", "w") as f:
    f.write(" ".join(["0.5"] * 16) + " ; " + " ".join(["0.5"] * 10) + "\n")
PY
"$python" "$dir/models.py" "$dir"
rc=0
"$serve" --listen 127.0.0.1:0 --devices cpu --model "$dir/three.pt" --requests 5 2> "$dir/err3" || rc=$?
[ "$rc" -ne 0 ] && grep -q "three.pt answers 1 rows with a tensor of shape \[1, 3\]" "$dir/err3" ||
  { echo "a model of 3 columns (rc $rc):"; cat "$dir/err3"; exit 1; }
rm "$dir/three.pt.ref.txt"
rc=0
"$serve" --listen 127.0.0.1:0 --devices cpu --model "$dir/three.pt" --requests 5 2> "$dir/err3" || rc=$?
[ "$rc" -ne 0 ] && grep -q "answers 1 rows with a tensor of shape \[1, 3\]" "$dir/err3" ||
  { echo "a model of 3 columns, no reference (rc $rc):"; cat "$dir/err3"; exit 1; }
echo "a model of 3 columns: refused with its shape"
# Served for real (no self-test) without a reference file: its warm-up refuses it. It started
# before, and every request got a 400 that blamed the client for the model's shape.
rc=0
timeout 60 "$serve" --listen 127.0.0.1:0 --devices cpu --model "$dir/flat.pt" 2> "$dir/errf" || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] &&
  grep -q "flat.pt answers 1 rows with a tensor of shape \[1\]" "$dir/errf" ||
  { echo "a model of flat answers, served (rc $rc):"; cat "$dir/errf"; exit 1; }
echo "a model of flat answers: refused at its warm-up"
start "$serve" --listen 127.0.0.1:0 --devices cpu --model "$dir/picky.pt" --max-batch 8 \
  --max-delay-us 200000
grep -q "the model refuses a call of 8 rows (it took 4).*at most 4 rows per call" "$dir/err"
python3 - "$port" <<'PY'
import http.client, json, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
c.request("POST", "/predict", body="1,2,3")
r = c.getresponse()
body = r.read().decode()
assert r.status == 400, (r.status, body)
assert json.loads(body)["error"] == "the model refused the input: builtins.ValueError: expected 16 features", body
c.request("POST", "/predict", body=",".join(["0.5"] * 16))
r = c.getresponse()
assert r.status == 200, (r.status, r.read())
r.read()
PY
stop
echo "a model that raises in TorchScript: its warm-up's limit found, a 400 with its words: ok"
