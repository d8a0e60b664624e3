import sys, os, ctypes, time
import torch
from blocktrain.node import memory
mode = sys.argv[1]
torch.set_num_threads(1)
m = torch.nn.Sequential(torch.nn.Linear(64,256), torch.nn.GELU(), torch.nn.Linear(256,64), torch.nn.LayerNorm(64))
opt = torch.optim.AdamW(m.parameters(), 1e-3)
def steps(n):
    for _ in range(n):
        x = torch.randn(32, 64, 64); loss = m(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
steps(20)
def rss():
    d = {}
    for l in open('/proc/self/status'):
        if l.startswith(('RssFile','RssAnon')): k,v,_ = l.split(); d[k]=int(v)/1024
    return d
print('before', rss())
if mode != 'none':
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    ranges = memory._code_mappings(open('/proc/self/smaps').read(), os.path.realpath(sys.executable))
    if mode == 'random':
        for a,b in ranges: print if madvise(a,b-a,1) else None   # MADV_RANDOM
    for a,b in ranges: madvise(a,b-a,4)
print('released', rss())
steps(300)
print('after', rss())
