#!/usr/bin/python3
"""resnet_torch.py -- the side-by-side reference for bench-accel's ResNet step.

The same model as accel/model.c's ac_resnet with ac_resnet_config_default (ResNet-20 for
28x28x1: stem conv3x3 1->16 without bias + batch norm + ReLU; 3 stages of 3 basic blocks,
widths 16/32/64, stride 2 at the first block of stages 2 and 3, a 1x1 conv + batch norm
shortcut where the stride or width changes; global average pooling; linear 64->10 with
bias; cross-entropy) and the same step as bench-accel --only models (zero the grads,
forward in training mode, backward; no optimizer update), batch 128, float32, NCHW.

Run with the Debian python3-torch (1.13, CPU) on the same cores as bench-accel:
    /usr/bin/python3 bench/reference/resnet_torch.py --threads 2 --reps 5
Prints the median and best step time (wall clock, and process CPU time with --clock cpu),
like bench-accel's "model" lines, then the same steps by the other clock (pass "step.cpu"
or "step.wall": both clocks are read around every step, so the two lines describe the same
steps), and the threads the process ran (intra-op, inter-op, OS threads). Compare with
bench-accel as a ratio measured in one session.
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, 0, bias=False),
                                       nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNet(nn.Module):
    def __init__(self, in_c=1, classes=10, widths=(16, 32, 64), blocks=3):
        super().__init__()
        self.stem = nn.Conv2d(in_c, widths[0], 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(widths[0], eps=1e-5, momentum=0.1)
        layers, c = [], widths[0]
        for s, w in enumerate(widths):
            for i in range(blocks):
                layers.append(BasicBlock(c, w, 2 if s > 0 and i == 0 else 1))
                c = w
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = F.relu(self.stem_bn(self.stem(x)))
        h = self.blocks(h)
        return self.fc(h.mean(dim=(2, 3)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed steps, run --reps more under torch.autograd.profiler and "
                    "print each op's self time per step (the calling thread's wall clock inside "
                    "the op: its intra-op threads work in the same interval)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    model = ResNet().train()
    x = torch.randn(a.batch, 1, 28, 28)
    labels = torch.randint(0, 10, (a.batch,))
    clocks = (time.perf_counter, time.process_time)
    if a.clock == "cpu":
        clocks = clocks[::-1]

    def step():
        model.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), labels)
        loss.backward()

    step()  # warm-up: allocations, oneDNN primitive creation
    times, other = [], []
    for _ in range(a.reps):
        t0, o0 = clocks[0](), clocks[1]()
        step()
        t1, o1 = clocks[0](), clocks[1]()
        times.append((t1 - t0) * 1e3)
        other.append((o1 - o0) * 1e3)
    cfg = "torch %s,threads=%d,%s resnet20,28x28x1,N=%d" % (torch.__version__, a.threads,
                                                           a.clock, a.batch)
    for name, t in (("step", times), ("step." + ("cpu" if a.clock == "wall" else "wall"), other)):
        print("  model    %s  %s  %10.3f ms %10.3f ms" % (cfg, name, statistics.median(t), min(t)))
    if a.profile:
        with torch.autograd.profiler.profile() as prof:
            for _ in range(a.reps):
                step()
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in rows)
        print("  profile  op  self_ms_per_step  share  calls_per_step")
        for e in rows:
            if e.self_cpu_time_total * 1000 < total:
                break
            print("  profile  %-40s %8.2f %6.1f%% %6.1f" % (e.key, e.self_cpu_time_total / 1e3 / a.reps,
                  100.0 * e.self_cpu_time_total / total, e.count / a.reps))
        print("  profile  total self ms per step %.2f" % (total / 1e3 / a.reps))
    print("  threads  intra-op %d, inter-op %d, OS threads of the process %d"
          % (torch.get_num_threads(), torch.get_num_interop_threads(),
             len(os.listdir("/proc/self/task"))))

if __name__ == "__main__":
    main()
