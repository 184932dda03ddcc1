"""MergeBench on Llama-3.2-3B (the FeatCal paper's LLM table): which hub models and datasets it reads, where a local
mirror holds them, how its calibration text is made, the merge hyper-parameters MergeBench uses, and the paper's
figures. Sources: MergeBench's code (github.com/uiuctml/MergeBench: merging/main.py, merging/taskloader.py,
scripts/merge.sh, scripts/evaluate.sh) and the FeatCal README (github.com/egangu/featcal).

The base is the pretrained `meta-llama/Llama-3.2-3B` (MergeBench's `--base-model` default), and the experts are
MergeBench's full fine-tunes of it, one per domain. Each domain's calibration and held-out text comes from
MergeBench's own held-out set, `MergeBench/{domain}_val` (one `train` split of about 1,000 rows: the data its RegMean
and RegMean++ read), rendered as those merges render it: an Alpaca-style prompt followed by the response. A local
mirror lays them out under their hub names:

    MODELS/meta-llama/Llama-3.2-3B               the base (config, weights, tokenizer)
    MODELS/MergeBench/Llama-3.2-3B_{domain}      one fine-tuned LlamaForCausalLM per domain
    DATA/MergeBench/{domain}_val                 `load_dataset("MergeBench/{domain}_val").save_to_disk(DIR)`
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal_bench.mirror import MirroredSpec

SPEC_FILE = "llm_bench.json"
BASE_MODEL = "meta-llama/Llama-3.2-3B"
SOURCE_SPLIT = "train"  # the only split of each `MergeBench/{domain}_val`

# Tokens per calibration and evaluation row (prompt and response; longer rows are cut at the end). MergeBench reads
# up to 2,048; 512 keeps the prompt and most of each response while making every forward pass and Gram 4× cheaper
# than 2,048 (attention's share aside). A FeatCal run on 5 domains × 256 rows is then at most 0.65 M tokens, each
# through the 3B model about 11 times (featcal_bench/estimate.py's 10.8 passes per example): some 45 PFLOP, about
# 10 minutes at 75 TFLOP/s on one GPU but days on a CPU (arithmetic, not a measurement).
MAX_LENGTH = 512
# Calibration pool per domain (MirroredSpec.calibration): the 256 examples the paper's other benchmarks use. The
# rest of each ~1,000-row set (about 740 rows) is held out for evaluation, so no calibrated row is ever scored.
CALIBRATION = 256

# The merge hyper-parameters MergeBench's scripts/merge.sh uses (its README's runs).
TA_SCALING = 0.4  # task arithmetic (and TIES) scaling coefficient
TIES_TOP_K = 0.3  # TIES keeps the top 30 % of each task vector by magnitude, sums the agreeing entries
REGMEAN_OFF_DIAGONAL = 0.5  # RegMean's `reduction`: the Gram's off-diagonal scale (featcal.regmean_off_diagonal)
REGMEAN_PP_OFF_DIAGONAL = 0.1  # RegMean++'s

# The FeatCal paper's figures for Llama-3.2-3B on MergeBench (its README's table), in %: an average of MergeBench's
# own harness scores (lm-eval, bigcode, safety-eval), not a token loss; how the average is formed is not known here.
PAPER = {"task arithmetic": 60.1, "TA + FeatCal": 62.1}

# Alpaca-style text, as MergeBench renders its `*_val` sets for RegMean: one header whether or not the row has an
# input, the "### Input:" section only when it has one, and the response after the prompt. (MergeBench's template
# also carries its source's indentation inside the string; that artefact is left out.)
HEADER = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.")
PROMPT = HEADER + "\n\n### Instruction:\n{instruction}\n\n### Response:\n{response}"
PROMPT_WITH_INPUT = HEADER + "\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{response}"


@dataclass(frozen=True)
class Domain:
    """One MergeBench domain: its held-out set's fields, and how MergeBench scores it (`harness_tasks`: the
    lm-evaluation-harness tasks, empty where it uses another harness, named in `other_harness`). The harness
    scores are not computed by this recipe; these fields say what to run to add them. MergeBench runs lm-eval
    without a chat template and without `--num_fewshot`, so each task's default applies (gsm8k_cot: 8-shot; the
    others 0-shot)."""

    about: str
    prompt: str  # the field holding the instruction
    response: str  # the field holding the answer
    harness_tasks: tuple[str, ...]
    other_harness: str | None = None
    input: str | None = None  # an optional second prompt field (Alpaca's input)

    def dataset(self, domain: str) -> str:
        return f"MergeBench/{domain}_val"

    def expert(self, domain: str) -> str:
        return f"MergeBench/{BASE_MODEL.split('/')[-1]}_{domain}"


MULTILINGUAL = tuple(f"{task}_{lang}" for task in ("m_mmlu", "arc", "hellaswag") for lang in ("fr", "es", "de", "ru"))
DOMAINS = {
    "instruction": Domain("instruction following (Tulu-3 IF)", "instruction", "output", ("ifeval",), input="input"),
    "math": Domain("mathematics (DART-Math)", "query", "response", ("gsm8k_cot",)),
    "multilingual": Domain("multilingual instructions (Aya)", "inputs", "targets", MULTILINGUAL),
    "coding": Domain("coding (Magicoder-Evol-Instruct)", "instruction", "response", (),
                     "bigcode-evaluation-harness: humanevalplus, mbppplus (pass@1)"),
    "safety": Domain("safety (WildGuardMix)", "prompt", "response", (),
                     "safety-eval: wildguardtest, harmbench, xstest, do_anything_now"),
}


class LlmBenchSpec(MirroredSpec):
    """A build of the MergeBench benchmark: its domains, calibration pool, held-out rows, seed, and where models and
    data come from (the hub when `models_from` / `data_from` are None, else a mirror laid out as the module says)."""

    SPEC_FILE = SPEC_FILE
    KNOWN_TASKS = tuple(DOMAINS)
    BASE_MODEL = BASE_MODEL

    def expert_id(self, domain: str) -> str:
        return DOMAINS[domain].expert(domain)

    def data_fill(self, domain: str) -> str:
        return f"load_dataset('{DOMAINS[domain].dataset(domain)}').save_to_disk(DIR)"

    def dataset_id(self, domain: str) -> tuple[str, str | None]:
        return DOMAINS[domain].dataset(domain), None

LLM_PRESETS = {"mergebench-llama-3.2-3b": LlmBenchSpec(name="mergebench-llama-3.2-3b", tasks=sorted(DOMAINS),
                                                       calibration=CALIBRATION)}
