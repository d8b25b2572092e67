import os, time
os.environ.setdefault("NIXL_LOG_LEVEL","WARN"); os.environ.setdefault("UCX_NET_DEVICES","lo")
import cProfile, pstats
from kvgeom.building import get_preset
from kvgeom_nixl.local import LocalDeployment, allocate_caches, fill_caches, slot_bytes_for
pair, req = get_preset("gqa-tp2-tp4").build(100, 16)
plan = pair.plan(req, strategy="packed")
p = allocate_caches(pair.prefill); d = allocate_caches(pair.decode); fill_caches(pair, req, p, d)
with LocalDeployment(pair, p, d, staging_bytes=slot_bytes_for(plan)) as dep:
    for i in range(3):
        t0 = time.perf_counter()
        res = dep.run(f"r{i}", req, plan)
        print(f"{(time.perf_counter()-t0)*1e3:.1f} ms", [ (r.kind, round(r.pack_s*1e3,2), round(r.wire_s*1e3,2), round(r.unpack_s*1e3,2)) for r in res])
    cProfile.run('dep.run("rp", req, plan)', '/tmp/prof2')
pstats.Stats('/tmp/prof2').sort_stats('cumulative').print_stats(25)
