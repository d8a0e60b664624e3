import json, sys
for n in sys.argv[1:]:
    r = json.load(open(f'/work/tools/s21_{n}.json'))
    run = list(r['runs'].values())[0]
    s = r['settings']
    print(n, 'recompute', s.get('recompute'), 'layer_ckpt', s.get('layer_checkpoint'), 'chain_ce', run['chain_ce'], 'completed', run['microbatches_completed'], 'lost', run['microbatches_lost'])
    for w in sorted(run['workers'], key=lambda w: w['block']):
        print('  block', w['block'], 'steps', w['steps'], 'peak', w['peak_rss_mib'], 'cpu_s', w['cpu_s'], 'completed', w['completed'], 'compute_s', w.get('compute_s'), 'times', {k: round(v,1) for k,v in (w.get('times_s') or {}).items()})
