import sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) < 6 or p[4] != '--block': continue
    rows[int(p[5])].append((int(p[0]), int(p[2]) / 1024, int(p[3]) / 1024))  # t, HWM, RSS
for b in sorted(rows):
    r = rows[b]; t0 = r[0][0]
    # first sample, min RSS over first 20 s, HWM at 140 s after first sample, last HWM
    first = r[0]
    hwm_at = lambda s: max([h for t, h, _ in r if t - t0 <= s] or [0])
    print(f"block {b}: samples {len(r)} span {r[-1][0]-t0}s first RSS {first[2]:.0f} HWM {first[1]:.0f}; "
          f"HWM@30s {hwm_at(30):.0f} @60 {hwm_at(60):.0f} @120 {hwm_at(120):.0f} @150 {hwm_at(150):.0f} last HWM {r[-1][1]:.0f} last RSS {r[-1][2]:.0f}")
