import time, sys
from kvgeom.building import get_preset
import cProfile, pstats
names = ["gqa-tp2-tp4", "llama3-70b-tp8-tp4", "llama3-70b-tp4-tp8", "deepseek-v3-tp8-tp1", "qwen-swa-tp2-tp4"]
for name in names:
    pair, req = get_preset(name).build(16384)
    pair.plan(req, strategy="packed")
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); plan = pair.plan(req, strategy="packed"); ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"{name:22s} {ts[2]*1e3:7.2f} ms chunks={len(plan.chunks)} packs={len(plan.packs)} unpacks={len(plan.unpacks)} wire={len(plan.wire)}")
if len(sys.argv) > 1:
    pair, req = get_preset(sys.argv[1]).build(16384)
    cProfile.run('for _ in range(5): pair.plan(req, strategy="packed")', '/tmp/prof')
    pstats.Stats('/tmp/prof').sort_stats('cumulative').print_stats(30)
