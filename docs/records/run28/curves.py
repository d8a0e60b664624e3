import json, sys
for f in sys.argv[1:]:
    d = json.loads(open(f).readline()); r = d['runs']['pipeline']
    print(f.split('/')[-1], 'ce', round(r['chain_ce'], 4), 'steps', r['workers'][0]['steps'], 'tok/s', round(r['tokens_per_s']),
          'lr_last', r['workers'][0]['lr_last'])
    print('   ', ' '.join(f"{p['steps']['mean']:.0f}:{p['ce']:.4f}" for p in r['curve']))
