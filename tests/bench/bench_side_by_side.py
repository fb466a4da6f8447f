"""Side-by-side prefill/decode figures: this project's CPU path against llama.cpp, same model.

What it measures, on a *medium random Ling-3 checkpoint* (hidden 1024, 8 layers = 6 KDA + 2 MLA
with ``layer_group_size`` 4, layer 0 dense, 16 heads, KDA head dim 128, MLA q_lora 256 /
kv_lora 512 / qk_nope 128 / qk_rope 64 / v 128, 32 routed experts top-8 in 4 groups (top 2
groups) of width 512 + 1 shared expert, dense FFN 3072, vocab 32000; 526 M parameters):

- the project: ``ling3-rknn convert CKPT BUNDLE --target cpu --experts int8``, loaded with
  ``Model.from_bundle(BUNDLE, threads=N)`` (and the process-wide CPU thread policy of
  ``ling3_rknn.cpu_threads`` where it exists). Prefill tok/s of a random 512-token prompt fed
  in chunks of ``--prefill-chunk`` (the engine's default, 64), then decode tok/s (greedy, one
  token per ``forward``, logits included) at each context of ``--contexts`` (default 512,
  4096, 12288). One state serves every context: prefill 512, decode ``--decode-tokens``,
  prefill on to exactly 4096, decode, on to 12288, decode (so "decode at C" covers positions
  C .. C+N-1, as llama-bench's ``tg N @ dC``). Per decoded token it also splits the time into
  the stage graphs (``model.stages``: embedding, attention in/out projections, shared
  expert, router logits, lm_head), the routed experts (``model.experts``) and the CPU glue
  (total - stages - experts), the glue further into KDA (conv + recurrence), MLA attention
  (RoPE + absorbed attention) and routing, by wrapping those calls with timers. Peak RSS is
  the child process's ``ru_maxrss`` (each measurement runs in its own process).
- llama.cpp (optional, ``--llama-bench PATH --gguf PATH``, or ``--llama-dir DIR`` to find
  ``DIR/src/build/bin/llama-bench`` and build the GGUF there itself): ``llama-bench -p 512
  -n 0 -d 0`` (pp512) and ``llama-bench -p 0 -n N -d 512,4096,12288`` (tg N at each depth),
  ``-t THREADS -r REPS -o json``, on a Q8_0 GGUF of the same checkpoint (llama.cpp's
  ``convert_hf_to_gguf.py`` to bf16, then ``llama-quantize ... Q8_0``; with ``--bits 4``
  the project's int4 stages and experts against Q4_0); its peak RSS is
  that of the llama-bench process. The ratios printed are project / llama.cpp (tok/s: > 1
  means the project is faster; RSS: > 1 means the project uses more).

Rounds are interleaved (project, llama.cpp, project, llama.cpp, ...) so load from other jobs
on the shared host hits both alike; the table shows the best round of each figure (the
least disturbed one) and ``--json`` keeps every round. Nothing asserts on wall time.

Run (the project's venv; the checkpoint is built in a child under ``.venv-oracle``, which
has torch 2.13 + transformers 5.24.0; checkpoint, bundle and GGUF are cached in ``--work``,
default ``tmp/bench_side_by_side`` in the repository, an ignored folder)::

    .venv/bin/python tests/bench/bench_side_by_side.py                 # project figures only
    .venv/bin/python tests/bench/bench_side_by_side.py --llama-dir LLAMA_DIR \\
        --threads 1,2 --rounds 2 --json side_by_side.json
    .venv/bin/python tests/bench/bench_side_by_side.py --llama-bench BIN --gguf MODEL.gguf
    .venv/bin/python tests/bench/bench_side_by_side.py --prefill-depths 0,4096,16384 \
        --contexts 512 --threads 1,2      # prefill of a 512-token piece at depth D as well

``--llama-dir DIR`` expects a llama.cpp source tree in ``DIR/src`` built with CMake into
``DIR/src/build`` (targets ``llama-bench`` and ``llama-quantize``) and a Python env in
``DIR/venv`` that can run its ``convert_hf_to_gguf.py`` (torch, transformers, its
``gguf-py``). The project never needs llama.cpp: without these options it prints only its
own figures.

Building llama.cpp for this: CPU only, Release, ``-DLLAMA_CURL=OFF -DGGML_OPENMP=ON``, targets
``llama-bench llama-quantize``. On a host whose ``/proc/cpuinfo`` lists AMX but whose kernel or
hypervisor does not let a process use it (this one: a Xeon behind a sandbox), do *not* use
``-DGGML_NATIVE=ON``: it compiles ggml's AMX buffer type in, which then takes the Q8_0 weights
and either dies with SIGILL in ``tinygemm_kernel_amx`` or, for the MLA ``attn_k_b`` / ``attn_v_b``
3-D matmuls it cannot run, stops the graph reservation with ``GGML_ASSERT(*cur_backend_id !=
-1)``. Name the ISA instead, e.g. ``-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON`` with the three
``GGML_AMX_*`` OFF (``llama-bench --repack 0`` also avoids it, but turns off the weight
repacking llama.cpp normally uses, so it would understate llama.cpp).

The GGUF conversion: llama.cpp's converter registers the released checkpoint's architecture
name ``BailingMoeV3ForCausalLM`` (arch ``bailingmoe3``), not transformers'
``BailingHybridForCausalLM``, and reads the released tensor names and config keys; so the
checkpoint here is written in the released layout (as ``tests/oracle/make_fixtures.py``'s
``plainq_released``, plus ``num_experts`` beside ``num_local_experts``: llama.cpp's converter
reads the former), which the project's converter reads as well. Its tokenizer is the
project's test tokenizer ``tests/fixtures/tokenizer/compact`` (1000 byte-level BPE tokens
with Ling's bailingmoe2 split regex; ids 1000..31999 become ``[PAD]`` entries in the GGUF);
the bench feeds token ids only, so the tokenizer does not affect the figures. The converter
runs through a small wrapper (``GGUF_WRAPPER``) that replaces two answers:

1. hparams: the converter takes them from ``AutoConfig``, and transformers 5.24.0 knows
   ``bailing_hybrid``: it renames the released keys (``norm_topk_prob``,
   ``num_local_experts``, ``n_group``, ...) and turns ``head_dim`` into the MLA value, so the
   converter stops on ``KeyError: 'norm_topk_prob'``. The wrapper hands it ``config.json``
   as written (what it gets under a transformers that predates ``bailing_hybrid``).
2. pre-tokenizer: the converter names it by hashing the token ids of a test string, which
   only matches a released vocabulary; the wrapper answers ``bailingmoe2`` (the regex this
   tokenizer really uses).

Figures (this host: 2 cores of a Xeon with AVX-512, load average ~1 from this run alone;
``--rounds 1 --threads 1``, defaults otherwise; llama.cpp: the tree vendored in the
llama-cpp-python 0.3.36 source distribution, ggml 0.25.3, built as above; tok/s):

    figure              project  llama.cpp  ratio
    prefill 512            45.5       82.0   0.56
    decode @512            24.5       20.3   1.21
    decode @4096           22.1       14.5   1.53
    decode @12288          19.1        9.6   1.99
    peak RSS MiB           1204        750   1.60

    project ms per token: total = stages / experts / glue (kda / mla / route / other)
    @512     40.8 = 23.1 / 12.6 /  5.1 (2.2 /  1.6 / 0.5 / 0.8)
    @4096    45.2 = 22.2 / 12.0 / 11.1 (2.1 /  7.7 / 0.5 / 0.8)
    @12288   52.3 = 19.3 / 10.5 / 22.5 (1.9 / 19.5 / 0.4 / 0.7)

One round each, so a figure can be off by ~25 % (a plumbing run minutes earlier measured
the project's prefill at 61 tok/s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ORACLE_PYTHON = REPO / ".venv-oracle" / "bin" / "python"
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer" / "compact" / "tokenizer.json"
DEFAULT_WORK = REPO / "tmp" / "bench_side_by_side"

# BailingHybridConfig kwargs (transformers 5.24.0 spelling, as tests/oracle/make_fixtures.py).
MEDIUM: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=512,
    num_hidden_layers=8,
    layer_group_size=4,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,  # KDA head dim
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_local_experts=32,
    num_experts_per_tok=8,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    short_conv_kernel_size=4,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    rope_theta=6_000_000.0,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=None,
    tie_word_embeddings=False,
    num_mtp_layers=0,
)
CHECKPOINT_SEED = 0

# transformers' save_pretrained spelling -> the released config.json spelling.
RELEASED_KEYS = {
    "model_max_length": "max_position_embeddings",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "num_shared_experts": "n_shared_experts",
}
# Released checkpoints keep these in float32; everything else is bf16.
FP32_SUFFIXES = (".A_log", ".dt_bias", ".gate.weight", ".gate.expert_bias")

# Runs llama.cpp's convert_hf_to_gguf.py with two answers replaced (see the module docstring):
# the hparams are config.json as written (transformers 5.24's AutoConfig knows
# ``bailing_hybrid`` and renames the released keys), and the pre-tokenizer is bailingmoe2.
GGUF_WRAPPER = """\
import json, runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
def load_hparams(dir_model, is_mistral_format):
    with open(dir_model / "config.json", encoding="utf-8") as f:
        return json.load(f)
base.ModelBase.load_hparams = staticmethod(load_hparams)
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "bailingmoe2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# ---------------------------------------------------------------- the checkpoint (oracle env)
def build_checkpoint(out: Path, seed: int) -> None:
    """Random ``BailingHybridForCausalLM`` at MEDIUM dims, written in the released layout.

    Runs under ``.venv-oracle`` (torch + transformers 5.24.0)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    assert transformers.__version__ == "5.24.0", transformers.__version__
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = BailingHybridForCausalLM(BailingHybridConfig(**MEDIUM)).float().eval()
    with torch.no_grad():  # the init of tests/oracle/make_fixtures.py: fan-in scaled
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif n.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            elif n.endswith(("A_log", "dt_bias")):
                continue  # HF's init
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(2, MEDIUM["vocab_size"], (1, 32), generator=gen)
        logits = model(ids, use_cache=False).logits
    peak = logits.abs().max().item()
    if not torch.isfinite(logits).all() or peak > 1e4:
        raise RuntimeError(f"random checkpoint gives |logits| max {peak}: init too large")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  built {n_params / 1e6:.0f} M parameters in {time.perf_counter() - t0:.0f} s, "
        f"|logits| max {peak:.1f} on 32 tokens")

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        model.save_pretrained(tmp)
        saved = json.loads((Path(tmp) / "config.json").read_text())
        tensors = load_file(Path(tmp) / "model.safetensors")
    layer_types = model.config.layer_types
    del model
    renamed = {}
    for name, t in tensors.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer is not None and layer_types[layer] == "linear_attention" \
                and name.endswith("attention.dense.weight"):
            name = name.replace("attention.dense.weight", "attention.o_proj.weight")
        dtype = torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16
        renamed[name] = t.to(dtype).contiguous()
    del tensors
    assert any(".attention.o_proj." in n for n in renamed), "no KDA output projection"
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})

    config = {RELEASED_KEYS.get(k, k): v for k, v in saved.items()}
    config["head_dim"] = saved["linear_head_dim"]  # released: head_dim is the KDA head dim
    for key in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "layer_types",
                "mlp_layer_types", "qk_head_dim", "rope_parameters"):
        config.pop(key, None)
    config.update(
        architectures=["BailingMoeV3ForCausalLM"],  # what llama.cpp's converter registers
        dtype="bfloat16",
        rope_theta=MEDIUM["rope_theta"],
        rope_scaling=None,
        rope_interleave=True,
        partial_rotary_factor=0.5,
        rotary_dim=MEDIUM["qk_rope_head_dim"],
        num_kv_heads_for_linear_attn=0,
        use_kda_lora=False,
        no_kda_lora=True,
        score_function="sigmoid",
        topk_method="noaux_tc",
        router_dtype="fp32",
        moe_router_enable_expert_bias=True,
        gated_attention_proj_granularity_type="head_wise",
        moe_shared_expert_intermediate_size=MEDIUM["moe_intermediate_size"],
        expert_swiglu_limit_list=None,
        share_expert_swiglu_limit_list=None,
        kda_lower_bound=MEDIUM["kda_lower_bound"],
        num_nextn_predict_layers=0,
        # llama.cpp's BailingMoeV3 converter reads ``num_experts`` (the project reads
        # ``num_local_experts`` first, then ``num_experts``): both, same value.
        num_experts=MEDIUM["num_local_experts"],
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(TOKENIZER, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|role_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": MEDIUM["max_position_embeddings"],
    }, indent=2) + "\n")


def _stamp(seed: int) -> dict[str, Any]:
    return {"config": MEDIUM, "seed": seed, "transformers": "5.24.0", "layout": 2,
            "tokenizer_bytes": TOKENIZER.stat().st_size}


def ensure_checkpoint(work: Path, oracle_python: Path, seed: int) -> Path:
    ckpt = work / "checkpoint"
    stamp = ckpt / "bench_stamp.json"
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(_stamp(seed))):
        return ckpt
    if ckpt.exists():
        shutil.rmtree(ckpt)
    log(f"building the random checkpoint in {ckpt} (under {oracle_python}) ...")
    subprocess.run([str(oracle_python), __file__, "--_build-checkpoint", str(ckpt),
                    "--seed", str(seed)], check=True)
    stamp.write_text(json.dumps(_stamp(seed), indent=2) + "\n")
    return ckpt


# Bumped when the converter's --target cpu output changes, so a cached bundle is rebuilt
# (2: stage graphs fused for onnxruntime, convert/cpu_graph.py; 3: no Split/Concat in final).
BUNDLE_REVISION = 3


# The project's conversion and llama.cpp's quantization compared at each width: int8
# stages and experts against Q8_0 (the default), int4 against Q4_0 (block 32 both; the
# board's routed experts are int4).
QUANTS = {8: (["--experts", "int8"], "Q8_0"), 4: (["--quant", "int4", "--experts", "int4"], "Q4_0")}


def ensure_bundle(ckpt: Path, work: Path, cli: list[str], bits: int = 8) -> Path:
    bundle = work / f"bundle-cpu-int{bits}"
    stamp = bundle / "bench_source.json"
    source = json.loads((ckpt / "bench_stamp.json").read_text())
    source["bundle_revision"] = BUNDLE_REVISION
    if stamp.exists() and json.loads(stamp.read_text()) == source:
        return bundle
    log(f"converting to {bundle} ...")
    t0 = time.perf_counter()
    subprocess.run([*cli, "convert", str(ckpt), str(bundle), "--target", "cpu",
                    *QUANTS[bits][0], "--overwrite"], check=True)
    log(f"  converted in {time.perf_counter() - t0:.0f} s")
    stamp.write_text(json.dumps(source, indent=2) + "\n")
    return bundle


def ensure_gguf(ckpt: Path, work: Path, llama_dir: Path, bits: int = 8) -> Path:
    """bf16 GGUF with llama.cpp's converter, then Q8_0 with llama-quantize; Q4_0 is
    quantized from that Q8_0 (``--allow-requantize``: the bf16 file is not kept; the double
    rounding changes values, not the kernels timed) with ``--pure`` (every tensor Q4_0, as
    the project's int4 conversion)."""
    qtype = QUANTS[bits][1]
    gguf = work / f"ling3-medium-{qtype}.gguf"
    stamp = work / ("gguf_source.json" if bits == 8 else f"gguf_source-{qtype}.json")
    source = json.loads((ckpt / "bench_stamp.json").read_text())
    if gguf.exists() and stamp.exists() and json.loads(stamp.read_text()) == source:
        return gguf
    src, py = llama_dir / "src", llama_dir / "venv" / "bin" / "python"
    quantize = src / "build" / "bin" / "llama-quantize"
    if bits != 8:
        q8 = ensure_gguf(ckpt, work, llama_dir, 8)
        log(f"quantizing {q8.name} to {gguf} ...")
        subprocess.run([str(quantize), "--allow-requantize", "--pure", str(q8), str(gguf),
                        qtype], check=True, stdout=subprocess.DEVNULL)
        stamp.write_text(json.dumps(source, indent=2) + "\n")
        return gguf
    bf16 = work / "ling3-medium-bf16.gguf"
    log(f"converting to {bf16} with llama.cpp's convert_hf_to_gguf.py ...")
    subprocess.run([str(py), "-c", GGUF_WRAPPER, str(src), str(ckpt), "--outtype", "bf16",
                    "--outfile", str(bf16)], check=True)
    log(f"quantizing to {gguf} ...")
    subprocess.run([str(quantize), str(bf16), str(gguf), "Q8_0"], check=True,
                   stdout=subprocess.DEVNULL)
    bf16.unlink()
    stamp.write_text(json.dumps(source, indent=2) + "\n")
    return gguf


# ------------------------------------------------------------------ child processes + RSS
def run_child(cmd: list[str]) -> tuple[str, int, float]:
    """Run ``cmd``; return (stdout, peak RSS in bytes of that process, wall seconds)."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode()
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, cmd, text)
    return text, usage.ru_maxrss * 1024, wall


# ---------------------------------------------------------------------- project (child side)
class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.on = False

    def wrap(self, bucket: str, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[bucket] = self.seconds.get(bucket, 0.0) + time.perf_counter() - t0
        return timed


class _TimedStages:
    def __init__(self, inner, timers: _Timers) -> None:
        self._inner, self._timers = inner, timers

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        return self._timers.wrap("stages", attr) if callable(attr) else attr


def install_timers(model) -> _Timers:
    from ling3_rknn.model import model as model_module

    timers = _Timers()
    model.stages = _TimedStages(model.stages, timers)
    model.experts = timers.wrap("experts", model.experts)
    # kda_decode: the compiled decode step (the kda column read 0.0 while it went untimed)
    glue = {"short_conv": "glue_kda", "prepare_qkv": "glue_kda", "kda_core": "glue_kda",
            "kda_decode": "glue_kda", "apply_rope": "glue_mla", "mla_attention": "glue_mla",
            "expanded_attention": "glue_mla", "route": "glue_route"}
    for name, bucket in glue.items():  # module globals that Model.forward calls
        if callable(getattr(model_module, name, None)):
            setattr(model_module, name, timers.wrap(bucket, getattr(model_module, name)))
    return timers


def split_ms(seconds: dict[str, float], total_s: float, tokens: int) -> dict[str, float]:
    """Per-token milliseconds by part: stages, experts, and the glue (the rest of the
    wall time) with its KDA, MLA and routing shares."""
    ms = {k: 1e3 * v / tokens for k, v in seconds.items()}
    stages, experts = ms.get("stages", 0.0), ms.get("experts", 0.0)
    glue = 1e3 * total_s / tokens - stages - experts
    parts = {"stages": stages, "experts": experts, "glue": glue,
             "glue_kda": ms.get("glue_kda", 0.0), "glue_mla": ms.get("glue_mla", 0.0),
             "glue_route": ms.get("glue_route", 0.0)}
    parts["glue_other"] = glue - parts["glue_kda"] - parts["glue_mla"] - parts["glue_route"]
    return parts


def measure_project(bundle: str, threads: int, prompt: int, contexts: list[int],
                    decode_tokens: int, chunk: int, seed: int,
                    depths: list[int] | None = None) -> dict[str, Any]:
    import numpy as np

    policy = "Model.from_bundle(threads=N) only"
    try:
        from ling3_rknn.cpu_threads import apply_thread_policy
    except ImportError:
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(limits=1, user_api="blas")
            policy += " + BLAS held to 1 thread"
        except ImportError:
            pass
    else:
        p = apply_thread_policy(threads)
        policy = f"ling3_rknn.cpu_threads: {p.threads} thread(s) on cores {list(p.cpus)}"
    from ling3_rknn.model import Model

    t0 = time.perf_counter()
    model = Model.from_bundle(bundle, threads=threads)
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)

    def feed(ids, state):
        logits = None
        for s in range(0, len(ids), chunk):
            logits = model.forward(ids[s:s + chunk], state, last_only=True)
        return logits

    warm = model.new_state()  # first runs of every graph (session warm-up), not timed
    feed(rng.integers(2, vocab, chunk), warm)
    model.forward([3], warm, last_only=True)
    del warm

    timers = install_timers(model)
    state = model.new_state()
    timers.on = True
    t0 = time.perf_counter()
    logits = feed(rng.integers(2, vocab, prompt), state)
    prefill_s = time.perf_counter() - t0
    timers.on = False
    res: dict[str, Any] = {
        "threads": threads, "thread_policy": policy, "load_s": load_s,
        "prefill": {"tokens": prompt, "chunk": chunk, "seconds": prefill_s,
                    "tok_s": prompt / prefill_s,
                    "ms_per_token": split_ms(timers.seconds, prefill_s, prompt)},
        "decode": [], "fill": [],
    }
    for ctx in contexts:
        if state.length < ctx:
            n = ctx - state.length
            t0 = time.perf_counter()
            logits = feed(rng.integers(2, vocab, n), state)
            dt = time.perf_counter() - t0
            res["fill"].append({"from": ctx - n, "to": ctx, "seconds": dt, "tok_s": n / dt})
        start = state.length
        timers.seconds.clear()
        timers.on = True
        steps = []
        tok = int(np.argmax(logits[-1]))
        for _ in range(decode_tokens):
            t0 = time.perf_counter()
            logits = model.forward([tok], state, last_only=True)
            tok = int(np.argmax(logits[-1]))
            steps.append(time.perf_counter() - t0)
        timers.on = False
        total = sum(steps)
        res["decode"].append({
            "context": ctx, "start": start, "tokens": decode_tokens, "tok_s": decode_tokens / total,
            "ms_per_token_median": 1e3 * statistics.median(steps),
            "ms_per_token": split_ms(timers.seconds, total, decode_tokens),
        })
    res["prefill_depth"] = []
    depth_state = model.new_state()  # a piece of ``prompt`` tokens after D, as llama-bench -d D
    for depth in sorted(depths or []):
        if depth_state.length < depth:
            feed(rng.integers(2, vocab, depth - depth_state.length), depth_state)
        t0 = time.perf_counter()
        feed(rng.integers(2, vocab, prompt), depth_state)
        dt = time.perf_counter() - t0
        res["prefill_depth"].append({"depth": depth, "tokens": prompt, "seconds": dt,
                                     "tok_s": prompt / dt})
    status = Path("/proc/self/status").read_text().splitlines()
    res["vm_hwm_kb"] = next((int(s.split()[1]) for s in status if s.startswith("VmHWM")), None)
    return res


def run_project(bundle: Path, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = dict(bundle=str(bundle), threads=threads, prompt=args.prompt, contexts=args.contexts,
                decode_tokens=args.decode_tokens, chunk=args.prefill_chunk, seed=args.seed,
                depths=args.prefill_depths)
    text, rss, wall = run_child([sys.executable, __file__, "--_project", json.dumps(spec)])
    res = json.loads(text.strip().splitlines()[-1])
    res["peak_rss_bytes"], res["wall_s"] = rss, wall
    return res


# ------------------------------------------------------------------------------- llama.cpp
def run_llama(bench: Path, gguf: Path, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    base = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", str(args.llama_reps),
            "-o", "json"]
    depths = sorted({0, *args.prefill_depths})
    pp_text, pp_rss, _ = run_child([*base, "-p", str(args.prompt), "-n", "0",
                                    "-d", ",".join(map(str, depths))])
    tg_text, tg_rss, _ = run_child([*base, "-p", "0", "-n", str(args.decode_tokens),
                                    "-d", ",".join(map(str, args.contexts))])
    pp, tg = json.loads(pp_text), json.loads(tg_text)
    first = next(r for r in pp if r.get("n_depth", 0) == 0)
    return {
        "threads": threads,
        "prefill": {"tokens": first["n_prompt"], "tok_s": first["avg_ts"],
                    "stddev": first["stddev_ts"]},
        "prefill_depth": [{"depth": r.get("n_depth", 0), "tokens": r["n_prompt"],
                           "tok_s": r["avg_ts"]} for r in pp],
        "decode": [{"context": r["n_depth"], "tokens": r["n_gen"], "tok_s": r["avg_ts"],
                    "stddev": r["stddev_ts"]} for r in tg],
        "peak_rss_bytes": max(pp_rss, tg_rss),
        "build": {k: first.get(k) for k in ("build_commit", "build_number", "cpu_info",
                                            "backends", "model_type", "model_size",
                                            "model_n_params", "type_k", "type_v",
                                            "flash_attn", "n_batch", "n_ubatch")},
    }


# ------------------------------------------------------------------------------ reporting
def _print_split(label: str, tok_s: float, m: dict[str, float]) -> None:
    print(f"  {label:<14} {1e3 / tok_s:7.1f} ms = {m['stages']:6.1f} / {m['experts']:6.1f} / "
          f"{m['glue']:6.1f} ({m['glue_kda']:.1f} / {m['glue_mla']:.1f} / "
          f"{m['glue_route']:.1f} / {m['glue_other']:.1f})")


def best(rounds: list[dict[str, Any]], key) -> float | None:
    vals = [v for v in (key(r) for r in rounds) if v is not None]
    return max(vals) if vals else None


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for threads in results["threads"]:
        proj = [r for r in results["project"] if r["threads"] == threads]
        llama = [r for r in results["llama"] if r["threads"] == threads]

        def decode(ctx, r):
            return next((d["tok_s"] for d in r["decode"] if d["context"] == ctx), None)

        def prefill_at(depth, r):
            return next((d["tok_s"] for d in r.get("prefill_depth", [])
                         if d["depth"] == depth), None)

        figures = [(f"prefill {results['prompt']} tok/s", lambda r: r["prefill"]["tok_s"])]
        figures += [(f"prefill {results['prompt']} @{d}", lambda r, d=d: prefill_at(d, r))
                    for d in results.get("prefill_depths", [])]
        figures += [(f"decode @{c} tok/s", lambda r, c=c: decode(c, r))
                    for c in results["contexts"]]
        for name, key in figures:
            p, q = best(proj, key), best(llama, key)
            rows.append({"threads": threads, "figure": name, "project": p, "llama": q,
                         "ratio": p / q if p and q else None})
        p = min(r["peak_rss_bytes"] for r in proj) / 2**20
        q = min(r["peak_rss_bytes"] for r in llama) / 2**20 if llama else None
        rows.append({"threads": threads, "figure": "peak RSS MiB", "project": p, "llama": q,
                     "ratio": p / q if q else None})
    return rows


def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def print_report(results: dict[str, Any]) -> None:
    with_llama = bool(results["llama"])
    print(f"\nmodel: medium random Ling-3 ({results['model']}); load average at start "
          f"{results['load_start']}, at end {results['load_end']}")
    head = f"{'threads':>7}  {'figure':<22} {'project':>10}"
    if with_llama:
        head += f" {'llama.cpp':>10} {'ratio':>7}"
    print(head)
    for row in results["summary"]:
        line = f"{row['threads']:>7}  {row['figure']:<22} {fmt(row['project']):>10}"
        if with_llama:
            line += f" {fmt(row['llama']):>10} {fmt(row['ratio'], 2):>7}"
        print(line)
    print("\nproject ms per token (best round): stages / experts / glue "
          "(kda / mla / route / other)")
    for threads in results["threads"]:
        proj = [r for r in results["project"] if r["threads"] == threads]
        first = max((r["prefill"] for r in proj), key=lambda p: p["tok_s"])
        if "ms_per_token" in first:
            _print_split(f"t={threads} prefill", first["tok_s"], first["ms_per_token"])
        for ctx in results["contexts"]:
            runs = [d for r in proj for d in r["decode"] if d["context"] == ctx]
            d = max(runs, key=lambda d: d["tok_s"])
            _print_split(f"t={threads} @{ctx}", d["tok_s"], d["ms_per_token"])
    if with_llama:
        b = results["llama"][0]["build"]
        print(f"\nllama.cpp: build {b.get('build_commit')} ({b.get('build_number')}), "
              f"{b.get('model_type')}, {b.get('backends')}, flash_attn {b.get('flash_attn')}, "
              f"K/V {b.get('type_k')}/{b.get('type_v')}; ratio = project / llama.cpp")


# ------------------------------------------------------------------------------------ main
def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK,
                    help="cache for checkpoint, bundle, GGUF (default %(default)s)")
    ap.add_argument("--threads", type=parse_ints, default=[1], help="e.g. 1 or 1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512, help="prefill length (tokens)")
    ap.add_argument("--contexts", type=parse_ints, default=[512, 4096, 12288])
    ap.add_argument("--prefill-depths", type=parse_ints, default=[],
                    help="also time a --prompt piece after D tokens (llama-bench -p P -d D), "
                         "e.g. 0,4096,16384")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--bits", type=int, choices=sorted(QUANTS), default=8,
                    help="8: project int8 stages + experts vs llama.cpp Q8_0 (default); "
                         "4: int4 vs Q4_0")
    ap.add_argument("--seed", type=int, default=0, help="prompt ids")
    ap.add_argument("--oracle-python", type=Path, default=ORACLE_PYTHON)
    ap.add_argument("--llama-dir", type=Path,
                    help="llama.cpp tree (DIR/src built in DIR/src/build, venv in DIR/venv): "
                         "finds llama-bench and builds the Q8_0 GGUF")
    ap.add_argument("--llama-bench", type=Path, help="llama-bench binary")
    ap.add_argument("--gguf", type=Path, help="GGUF of the same checkpoint for llama-bench")
    ap.add_argument("--llama-reps", type=int, default=1, help="llama-bench -r")
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    ap.add_argument("--_build-checkpoint", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_project", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._build_checkpoint:
        build_checkpoint(args._build_checkpoint, args.seed)
        return 0
    if args._project:
        print(json.dumps(measure_project(**json.loads(args._project))))
        return 0

    if args.contexts != sorted(args.contexts) or args.contexts[0] < args.prompt:
        ap.error("--contexts must be ascending and start at or after --prompt")
    bench, gguf = args.llama_bench, args.gguf
    if args.llama_dir and bench is None:
        bench = args.llama_dir / "src" / "build" / "bin" / "llama-bench"
    if gguf is not None and bench is None:
        ap.error("--gguf needs --llama-bench or --llama-dir")
    if bench is not None and gguf is None and args.llama_dir is None:
        ap.error("--llama-bench needs --gguf or --llama-dir")

    args.work.mkdir(parents=True, exist_ok=True)
    cli = REPO / ".venv" / "bin" / "ling3-rknn"
    cli_cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "ling3_rknn.cli"]
    ckpt = ensure_checkpoint(args.work, args.oracle_python, CHECKPOINT_SEED)
    bundle = ensure_bundle(ckpt, args.work, cli_cmd, args.bits)
    if bench is not None and gguf is None:
        gguf = ensure_gguf(ckpt, args.work, args.llama_dir, args.bits)

    results: dict[str, Any] = {
        "model": "hidden 1024, 8 layers (6 KDA + 2 MLA), 32 experts top-8 x 512 + shared, "
                 "vocab 32000; project: --target cpu "
                 + " ".join(QUANTS[args.bits][0]) + f"; llama.cpp: {QUANTS[args.bits][1]}",
        "checkpoint": str(ckpt), "bundle": str(bundle),
        "gguf": str(gguf) if gguf else None, "llama_bench": str(bench) if bench else None,
        "threads": args.threads, "rounds": args.rounds, "prompt": args.prompt,
        "contexts": args.contexts, "decode_tokens": args.decode_tokens,
        "prefill_chunk": args.prefill_chunk, "llama_reps": args.llama_reps,
        "prefill_depths": args.prefill_depths,
        "load_start": load_average(), "project": [], "llama": [],
    }
    for rnd in range(args.rounds):
        for threads in args.threads:
            log(f"round {rnd + 1}/{args.rounds}, {threads} thread(s): project ...")
            r = run_project(bundle, threads, args)
            r["round"] = rnd
            results["project"].append(r)
            log(f"  prefill {r['prefill']['tok_s']:.1f} tok/s, decode "
                + ", ".join(f"@{d['context']} {d['tok_s']:.2f}" for d in r["decode"])
                + f" tok/s, {r['wall_s']:.0f} s")
            if bench is not None:
                log(f"round {rnd + 1}/{args.rounds}, {threads} thread(s): llama-bench ...")
                q = run_llama(bench, gguf, threads, args)
                q["round"] = rnd
                results["llama"].append(q)
                log(f"  prefill {q['prefill']['tok_s']:.1f} tok/s, decode "
                    + ", ".join(f"@{d['context']} {d['tok_s']:.2f}" for d in q["decode"])
                    + " tok/s")
    results["load_end"] = load_average()
    results["summary"] = summarize(results)
    print_report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
