import resource, sys, time, torch, tempfile
from pathlib import Path
from blocktrain.blocks.config import ModelConfig
from blocktrain.node.trainer import BlockTrainer
import numpy as np
from blocktrain.node.memory import tune_malloc; tune_malloc()
def rss():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])/1024
def hwm():
    for l in open("/proc/self/status"):
        if l.startswith("VmHWM"): return int(l.split()[1])/1024
cfg = ModelConfig(objective="pipeline", d_model=768, n_heads=12, layers_per_block=3, n_blocks=4, seq_len=256, batch_size=16, target_dim=16)
data = np.frombuffer(bytes(range(256))*4000, dtype=np.uint8)
t = BlockTrainer(cfg, 1, data, data)
for p in t.module.parameters(): p.grad=torch.zeros_like(p)
t.opt.step()
for p in t.module.parameters(): p.grad=None
import gc; gc.collect()
with open("/proc/self/clear_refs","w") as f: f.write("5")
r0=rss(); print("before save RSS", round(r0), "HWM(reset)", round(hwm()))
d=tempfile.mkdtemp()
t0=time.time(); t.save(d); print("save s", round(time.time()-t0,2))
print("after save RSS", round(rss()), "HWM", round(hwm()), "transient +", round(hwm()-r0))
