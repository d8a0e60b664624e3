import json, sys
for n in sys.argv[1:]:
    try: r = json.load(open(f'/work/tools/s21_{n}.json'))
    except Exception as e: print(n, 'missing'); continue
    b, f = r['block'], r['reference']
    print(f"{n}: block {r['block_index']} ckpt {r['layer_checkpoint']} recompute {b.get('recompute')} | block base/peak RSS {b['baseline_rss_mib']:.1f}/{b['peak_rss_mib']:.1f} live {b['live_peak_mib']:.1f} s {b['seconds']} cpu {b['cpu_seconds']} | whole base/peak {f['baseline_rss_mib']:.1f}/{f['peak_rss_mib']:.1f} live {f['live_peak_mib']:.1f} s {f['seconds']} cpu {f['cpu_seconds']} | RSS ratio {r['ratio_peak_rss']:.3f} live ratio {r['ratio_live_tensors']:.3f}")
