"""The eval tests' world: a small English corpus, two local lm-eval tasks written from it (a
LAMBADA-style last-word task and a wikitext-style perplexity task), a BPE trained on it, the tiny
GPT-2 they evaluate, and the switches that keep Hugging Face libraries offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.tiny_models import tiny_gpt2

HARBOUR_TEXT = """\
The harbour town wakes before the sun, when the fishing boats leave the quay.
Mara runs the bakery by the harbour, and every morning she bakes rye bread.
The baker sells warm rye bread to the fishermen before they sail.
At noon the ferry crosses the bay to the island with mail and tourists.
The ferry captain rings a brass bell when the ferry leaves the pier.
Old Tomas repairs nets on the quay and tells stories about the storm.
Children watch the gulls circle over the fish market near the pier.
In winter the wind from the north freezes the ropes on the boats.
The lighthouse on the cape flashes twice every ten seconds at night.
The keeper of the lighthouse writes the weather in a thick logbook.
On Sundays the town band plays old songs in the square by the fountain.
The train from the capital arrives at six and leaves again at seven.
Tourists buy postcards of the lighthouse and the harbour at the kiosk.
When the tide is low, the children collect shells along the sandy beach.
"""

LAMBADA_LINES = [
    "Every morning Mara bakes rye bread in the bakery by the harbour",
    "The ferry captain rings a brass bell when the ferry leaves the pier",
    "Old Tomas repairs nets on the quay and tells stories about the storm",
    "The lighthouse on the cape flashes twice every ten seconds at night",
    "On Sundays the town band plays old songs in the square by the fountain",
    "The train from the capital arrives at six and leaves again at seven",
    "Children watch the gulls circle over the fish market near the pier",
    "When the tide is low the children collect shells along the sandy beach",
    "The keeper of the lighthouse writes the weather in a thick logbook",
    "Tourists buy postcards of the lighthouse and the harbour at the kiosk",
]

WIKI_PAGES = [
    " = The Harbour = \n The harbour town wakes before the sun . The fishing boats leave the quay at dawn . ",
    " = The Bakery = \n Mara runs the bakery by the harbour . She bakes rye bread every morning . ",
    " = The Ferry = \n The ferry crosses the bay at noon . The captain rings a brass bell when it leaves the pier . ",
    " = The Lighthouse = \n " + "The lighthouse on the cape flashes twice every ten seconds at night . " * 12,
    " = Winter = \n In winter the wind from the north freezes the ropes on the boats . ",
    " = The Square = \n On Sundays the town band plays old songs in the square by the fountain . ",
]


def _task_yaml(name: str, data: Path, output_type: str, text: str, target: str, metrics: dict) -> str:
    """An lm-eval task config over a local JSONL file (written as JSON, which YAML reads)."""
    return json.dumps(
        {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "output_type": output_type,
            "test_split": "test",
            "doc_to_text": text,
            "doc_to_target": target,
            "metric_list": [
                {"metric": m, "aggregation": agg, "higher_is_better": hib} for m, (agg, hib) in metrics.items()
            ],
            "metadata": {"version": 1.0},
        },
        indent=1,
    )


def lambada_yaml(name: str, data: Path) -> str:
    """Last-word prediction: the context is the line but its last word, the target is that word."""
    return _task_yaml(
        name,
        data,
        "loglikelihood",
        "{{text.split(' ')[:-1]|join(' ')}}",
        "{{' '+text.split(' ')[-1]}}",
        {"perplexity": ("perplexity", False), "acc": ("mean", True)},
    )


def wiki_yaml(name: str, data: Path) -> str:
    """Rolling log-likelihood of whole pages."""
    return _task_yaml(
        name,
        data,
        "loglikelihood_rolling",
        "",
        "{{page}}",
        {
            "word_perplexity": ("weighted_perplexity", False),
            "byte_perplexity": ("weighted_perplexity", False),
            "bits_per_byte": ("bits_per_byte", False),
        },
    )


LOCAL_TASKS = ["harbour_lambada", "harbour_wiki"]


def write_local_tasks(folder: Path) -> Path:
    """The two local tasks (their JSONL data and their configs) written into a new `folder`."""
    folder.mkdir()
    with open(folder / "harbour_lambada.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in LAMBADA_LINES)
    with open(folder / "harbour_wiki.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"page": page}) + "\n" for page in WIKI_PAGES)
    (folder / "harbour_lambada.yaml").write_text(lambada_yaml("harbour_lambada", folder / "harbour_lambada.jsonl"))
    (folder / "harbour_wiki.yaml").write_text(wiki_yaml("harbour_wiki", folder / "harbour_wiki.jsonl"))
    return folder


def set_offline(mp: pytest.MonkeyPatch, root: Path) -> None:
    """HF libraries offline with caches under `root`, also when another test imported them already."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "HF_DATASETS_CACHE": str(root / "hf" / "datasets"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "DISABLE_MULTIPROC": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in env.items():
        mp.setenv(key, value)
    if "huggingface_hub" in sys.modules:
        mp.setattr(sys.modules["huggingface_hub"].constants, "HF_HUB_OFFLINE", True)
    if "datasets" in sys.modules:
        config = sys.modules["datasets"].config
        mp.setattr(config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(config, "HF_HUB_OFFLINE", True, raising=False)
        mp.setattr(config, "HF_DATASETS_CACHE", root / "hf" / "datasets")


def train_tokenizer(corpus: Path):
    """A 512-token byte-level BPE trained on `corpus` (the tiny models' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=64,
    )


def eval_gpt2(seed: int):
    """The tiny GPT-2 the eval tests save: a 512-token vocabulary (the BPE trained on the corpus) and 64 positions."""
    return tiny_gpt2(seed, vocab_size=512, n_positions=64)
