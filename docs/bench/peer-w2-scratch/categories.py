"""Shared by prof.py and prof_pfl.py: a torch.profiler run's self CPU time by category
(each event counted under its first ancestor that names one), printed per round and as a share
of the profiled wall time."""
import collections


def print_categories(prof, wall: float, rounds: int) -> None:
    """Print the categories of ``prof``'s events for ``rounds`` profiled rounds taking ``wall`` s."""
    PROF = rounds
    RULES = [
        ("conv backward", lambda n: n.startswith("autograd::engine::evaluate_function: ConvolutionBackward")),
        ("linear backward", lambda n: n.startswith("autograd::engine::evaluate_function: AddmmBackward") or n.startswith("autograd::engine::evaluate_function: TBackward") or n.startswith("autograd::engine::evaluate_function: MmBackward")),
        ("pool backward", lambda n: n.startswith("autograd::engine::evaluate_function: MaxPool")),
        ("relu backward", lambda n: n.startswith("autograd::engine::evaluate_function: ReluBackward") or n.startswith("autograd::engine::evaluate_function: ThresholdBackward")),
        ("loss backward", lambda n: n.startswith("autograd::engine::evaluate_function: ") and any(k in n for k in ("LogSoftmax", "Nll", "Mean", "Div", "CrossEntropy", "Sum"))),
        ("other backward", lambda n: n.startswith("autograd::engine::evaluate_function")),
        ("optimizer step", lambda n: n.startswith("Optimizer.step")),
        ("zero_grad", lambda n: n.startswith("Optimizer.zero_grad")),
        ("conv forward", lambda n: n in ("aten::conv2d",)),
        ("linear forward", lambda n: n in ("aten::linear",)),
        ("pool forward", lambda n: n in ("aten::max_pool2d",)),
        ("relu forward", lambda n: n in ("aten::relu",)),
        ("loss forward", lambda n: n in ("aten::cross_entropy_loss", "aten::log_softmax", "aten::nll_loss", "aten::mean", "aten::nll_loss_nd")),
        ("minibatch gather (index)", lambda n: n in ("aten::index", "aten::index_select")),
        ("backward driver", lambda n: n.startswith("autograd::engine") ),
    ]
    events = prof.events()
    agg = collections.Counter()
    names = collections.defaultdict(collections.Counter)
    for ev in events:
        node, cat = ev, None
        while node is not None:
            for c, rule in RULES:
                if rule(node.name):
                    cat = c
                    break
            if cat:
                break
            node = node.cpu_parent
        if cat is None:
            # top-level op name of the chain
            top = ev
            while top.cpu_parent is not None:
                top = top.cpu_parent
            cat = "other: " + top.name
        agg[cat] += ev.self_cpu_time_total
        names[cat][ev.name] += ev.self_cpu_time_total
    total_ops = sum(agg.values()) / 1e6
    print(f"\nprofiled wall {wall:.3f} s for {PROF} rounds; self CPU time of all ops {total_ops:.3f} s "
          f"(main thread + autograd; ops inside ops counted once)")
    for cat, us in agg.most_common():
        top = ", ".join(f"{n} {t/1e3:.0f}" for n, t in names[cat].most_common(3))
        print(f"{cat:38s} {us/1e3/PROF:8.1f} ms/round  {100*us/1e6/wall:5.1f}% of wall   [{top}]")
    print(f"{'not in any op (Python, etc.)':38s} {(wall - total_ops)*1e3/PROF:8.1f} ms/round  {100*(wall-total_ops)/wall:5.1f}% of wall")
    print("\n", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
