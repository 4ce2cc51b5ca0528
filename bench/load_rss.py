"""Peak RSS of loading a GGUF (quantized: auto, the CPU) and of then running it, one fresh process
per file: `python bench/load_rss.py [--repo DIR] [--prompt 622] [--decode 64] FILE_OR_ALIAS...`.

Each child reports ru_maxrss after `models.load` and after a prefill and greedy decode, with the
RSS split into anonymous memory (heap: copies) and file-backed pages (the mapped GGUF, and the
libraries). --repo measures another checkout of this repository (e.g. a commit before a change).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(2)
from engine.device import configure_process
import models
from engine.session import DecodeSession
configure_process()

def status():
    out = {}
    for line in open('/proc/self/status'):
        key, _, value = line.partition(':')
        if key in ('VmRSS', 'RssAnon', 'RssFile'):
            out[key] = int(value.split()[0]) / 1024
    return out

base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
lm = models.load(sys.argv[2], quantized=True)
load_s = time.perf_counter() - t
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
after_load = status()
s = DecodeSession(lm.model, max_context=2048, device=torch.device('cpu'), dtype=torch.float32)
ids = (lm.tokenizer.encode('The history of computing is a story of layers. ', add_special_tokens=False).ids * 200)
s.prefill(ids[:int(sys.argv[3])])
for i in range(int(sys.argv[4])):
    s.step(5 + i)
ran = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({'imports_mib': base, 'load_peak_mib': loaded, 'run_peak_mib': ran, 'load_s': load_s,
                  'after_load': after_load, 'weights': getattr(lm, 'weight_format', '?')}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--prompt", type=int, default=622)
    p.add_argument("--decode", type=int, default=64)
    a = p.parse_args()
    rows = []
    for m in a.models:
        out = subprocess.run([sys.executable, "-c", CHILD, a.repo, m, str(a.prompt), str(a.decode)],
                             capture_output=True, text=True, cwd=a.repo)
        if out.returncode != 0:
            print(f"{m}: failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((os.path.basename(m), r))
        al = r["after_load"]
        print(f"{os.path.basename(m)}: peak RSS {r['load_peak_mib']:.0f} MiB after load, {r['run_peak_mib']:.0f} MiB "
              f"after prefill {a.prompt} + decode {a.decode} (imports alone {r['imports_mib']:.0f}); after load "
              f"anon {al['RssAnon']:.0f} + file {al['RssFile']:.0f} MiB; load {r['load_s']:.1f} s; {r['weights']}")
    if len(rows) > 1:
        ref = rows[0][1]["run_peak_mib"]
        for name, r in rows[1:]:
            print(f"{name} / {rows[0][0]}: run peak {r['run_peak_mib'] / ref:.2f}x")


if __name__ == "__main__":
    main()
