# Does a thread that takes a lock for back-to-back compute jobs starve another thread waiting on it?
import threading, time, torch, statistics, queue, concurrent.futures as cf
torch.set_num_threads(1)
lock = threading.Lock()
a = torch.randn(192, 192)
stop = threading.Event()
ex = cf.ThreadPoolExecutor(1)
def job():
    with lock:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.004:
            a @ a
def feeder():           # keeps the compute executor's queue non-empty, as a busy pipeline stage would
    futs = []
    while not stop.is_set():
        futs = [f for f in futs if not f.done()]
        while len(futs) < 4:
            futs.append(ex.submit(job))
        time.sleep(0.001)
threading.Thread(target=feeder, daemon=True).start()
waits = []
t_end = time.time() + 6
while time.time() < t_end:
    t0 = time.perf_counter()
    with lock:
        waits.append(time.perf_counter() - t0)
    time.sleep(0.05)
stop.set()
waits.sort()
print(f"hop-like acquisitions: {len(waits)}, median wait {1000*statistics.median(waits):.1f} ms, p90 {1000*waits[int(0.9*len(waits))]:.1f} ms, max {1000*waits[-1]:.1f} ms")
