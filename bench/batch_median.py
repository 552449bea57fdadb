#!/usr/bin/env python3
# Runs `troupe_uneven_bench --producers 2 --only batch` N times and prints the median items/s of
# the adaptive run and of each fixed chunk size, and the adaptive / best-fixed ratio of medians
# (BENCHMARKS.md, "a batch producer's batches").
#   bench/batch_median.py build/bench/troupe_uneven_bench 10
import re,statistics,collections,subprocess,sys
binary=sys.argv[1]; runs=int(sys.argv[2])
d=collections.defaultdict(list); calls=[]
for i in range(runs):
    out = subprocess.run([binary, '--producers', '2', '--only', 'batch'],
                         capture_output=True, text=True).stdout
    for l in out.splitlines():
        m = re.match(r'batch (adaptive|chunk_size (\d+))\s+([\d.]+) s\s+(\d+) items/s'
                     r'\s+mean batch ([\d.]+)', l)
        if m:
            d[m.group(1)].append(int(m.group(4)))
            if m.group(1)=='adaptive': calls.append(float(m.group(5)))
for k,v in d.items(): print(f'{k:16s} median {statistics.median(v):8.0f}  range {min(v)}-{max(v)}')
best=max((statistics.median(v),k) for k,v in d.items() if k!='adaptive')
print('mean batch (adaptive) median', statistics.median(calls))
print('best fixed', best[1], 'ratio of medians', round(statistics.median(d['adaptive'])/best[0],3))
