"""How many copies of a model's weights one conversion holds at its peak.

A conversion needs the model it was given (1x) and the converted model (1x). Anything more is a copy
the engine did not need: a second deep copy kept as the reference, fp64 temporaries of a whole large
weight, a copy kept for a check that could read the input. Measured as the process's peak anonymous
resident memory (tensors; the file-backed pages of the libraries a run pages in are left out) above what
it held once the model was built, in a fresh process, on a model whose weights dwarf everything else in
the run (an HF GPT-2 with two 400 MB matrices, the embedding and the untied head, random weights).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    """
    import json, resource, sys, threading, time
    import torch, transformers
    import normswap
    from normswap import ConvertConfig

    def anonymous_rss():
        # resident minus file-backed pages: tensors, not the code of the libraries a run pages in
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * resource.getpagesize()

    class PeakSampler(threading.Thread):
        # the kernel keeps the peak of all resident memory only (file pages included): sampled instead,
        # every millisecond; a copy of the weights lives far longer than that
        def __init__(self):
            super().__init__(daemon=True)
            self.peak, self.running = anonymous_rss(), True

        def run(self):
            while self.running:
                self.peak = max(self.peak, anonymous_rss())
                time.sleep(0.001)

    def gpt2(vocab, layers):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=512, n_head=8, vocab_size=vocab, tie_word_embeddings=False
        )
        model = transformers.GPT2LMHeadModel(config).eval()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.uniform_(0.75, 1.25)
                    m.bias.uniform_(-0.5, 0.5)
        return model, {"input_ids": torch.randint(0, vocab, (1, 8))}

    # freed tensors leave the process (as distill sets it): glibc would otherwise keep a varying share of
    # the run's freed outputs in its heap, which is allocator slack, not a copy the engine held
    from normswap.util.freed_memory import give_back_freed_tensors

    give_back_freed_tensors()
    config = ConvertConfig(to=sys.argv[1], exact=True)
    # everything the conversion imports or caches, loaded on a small model first
    small, inputs = gpt2(256, 1)
    assert normswap.convert(small, config, example_kwargs=inputs).ok
    del small
    model, inputs = gpt2(int(sys.argv[2]), 1)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    base = anonymous_rss()
    sampler = PeakSampler()
    sampler.start()
    result = normswap.convert(model, config, example_kwargs=inputs)
    sampler.running = False
    sampler.join()
    peak = max(sampler.peak, anonymous_rss())
    all_pages_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "ok": result.ok, "weights": weight_bytes, "above_model": peak - base, "base": base,
        "all_pages_peak": all_pages_peak,
    }))
    """
)


@pytest.mark.parametrize("to", ["rmsnorm", "fused"])
def test_a_conversion_holds_the_model_and_its_converted_copy_and_no_more(to):
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, to, "200000"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["ok"]
    assert figures["weights"] > 400e6  # the embedding dominates: what is measured is weight copies
    copies = figures["above_model"] / figures["weights"]
    # The converted model is 1x. Measured 1.19x (rmsnorm) and 1.20x (fused): the rest is the outputs kept
    # to compare (200k-vocabulary logits on 4 input variants, before and after each pass) and the
    # allocator's slack. One more copy of either 400 MB matrix (the reference copy the pipeline used to
    # keep, fp64 temporaries of the embedding) adds 0.49x and fails; CI once measured 1.46x with all
    # resident pages counted (tests/test_memory.py before it sampled anonymous memory), hence the margin.
    assert copies <= 1.55, (
        f"the conversion held {copies:.2f}x the weight bytes above the model it was given: {figures}"
    )
