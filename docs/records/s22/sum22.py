"""Summarise s22r.sh's runs: per worker its block, optimizer steps, rounds accepted, peak RSS (bench
pipeline's figure) and the peak of the 1-s sampler's VmHWM.  python docs/records/s22/sum22.py N O"""
import collections
import gzip
import json
import os
import sys

for n in sys.argv[1:]:
    r = json.load(open(f'/work/tools/s22_{n}.json'))
    run = list(r['runs'].values())[0]
    s = r['settings']
    print(n, 'average_every', s.get('average_every'), 'recompute', s.get('recompute'), 'layer_ckpt',
          s.get('layer_checkpoint'), 'chain_ce', run['chain_ce'], 'completed', run['microbatches_completed'],
          'lost', run['microbatches_lost'])
    path = f'/work/tools/sampler22_{n}.log'
    opener = gzip.open if not os.path.exists(path) else open
    hwm = collections.defaultdict(int)
    for line in opener(path if os.path.exists(path) else path + '.gz', 'rt'):
        f = line.split()
        if len(f) >= 6 and f[-2] == '--block':
            hwm[(f[1], int(f[-1]))] = max(hwm[(f[1], int(f[-1]))], int(f[2]))
    for w in sorted(run['workers'], key=lambda w: w['block']):
        print('  block', w['block'], 'steps', w['steps'], 'rounds_ok', w.get('averaging_rounds_ok'),
              'peak', w['peak_rss_mib'], 'completed', w['completed'])
    print('  sampler VmHWM MiB by (pid, block):', {f'{p}/b{b}': round(v / 1024) for (p, b), v in sorted(hwm.items())})
