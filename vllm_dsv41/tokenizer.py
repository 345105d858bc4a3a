"""A small, deterministic DeepSeek-V4.1-style tokenizer for synthetic checkpoints.

Owns :func:`build_tokenizer`, which writes a Hugging Face fast tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``)
that ``transformers.AutoTokenizer`` and vLLM's ``--tokenizer-mode
deepseek_v41`` both load offline.

Layout of the id space:

* 0, 1, 2 — BOS ``<｜begin▁of▁sentence｜>``, EOS ``<｜end▁of▁sentence｜>``, PAD;
* then a byte-level BPE trained (deterministically) on the built-in corpus
  below — enough merges that greedy text from a toy model looks like words;
* then reserved placeholders ``<｜place▁holder▁no▁N｜>`` (plain vocabulary
  entries, never produced by encoding);
* the V4.1 chat / task / DSpark special tokens (architecture.md §1.4): at the
  very top of a small vocabulary, or at the official ids when the vocabulary
  is the full 129,280 (``<｜User｜>`` 128803, ``<｜Assistant｜>`` 128804,
  ``</think>`` 128822, DSpark noise 128799, ``<｜deepseek_image｜>`` 129264 —
  the latter is vLLM's hard-coded image sentinel).

The special tokens are registered as added tokens so encoding keeps them
whole; ``<think>``, ``</think>``, ``｜DSML｜`` and the role/task markers are
non-special (they survive ``skip_special_tokens`` decoding, which the
reasoning and tool parsers rely on).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
NOISE_TOKEN = "<｜dspark▁noise｜>"
THINK_START = "<think>"
THINK_END = "</think>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
DSML_TOKEN = "｜DSML｜"
FIM_HOLE = "<｜fim▁hole｜>"
FIM_BEGIN = "<｜fim▁begin｜>"
FIM_END = "<｜fim▁end｜>"
TASK_TOKENS = ("<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>",
               "<｜read_url｜>")

# (token, special?) in the order they occupy the top of a small vocabulary.
CHAT_TOKENS: tuple[tuple[str, bool], ...] = (
    (NOISE_TOKEN, True),
    (FIM_HOLE, True),
    (FIM_BEGIN, True),
    (FIM_END, True),
    (USER_TOKEN, False),
    (ASSISTANT_TOKEN, False),
    (SYSTEM_TOKEN, False),
    (LATEST_REMINDER_TOKEN, False),
    (DSML_TOKEN, False),
    *((t, False) for t in TASK_TOKENS),
    (THINK_START, False),
    (THINK_END, False),
    (IMAGE_TOKEN, True),
)

# Ids of the official 129,280-entry vocabulary.  User/Assistant/</think>/noise
# are from architecture.md §1.4, the image id is vLLM's IMAGE_SENTINEL_BASE_ID,
# FIM ids follow the DeepSeek-V3 tokenizer; the rest are our own choice.
OFFICIAL_VOCAB_SIZE = 129280
OFFICIAL_IDS: dict[str, int] = {
    NOISE_TOKEN: 128799,
    FIM_HOLE: 128800,
    FIM_BEGIN: 128801,
    FIM_END: 128802,
    USER_TOKEN: 128803,
    ASSISTANT_TOKEN: 128804,
    SYSTEM_TOKEN: 128805,
    LATEST_REMINDER_TOKEN: 128806,
    DSML_TOKEN: 128807,
    **{t: 128808 + i for i, t in enumerate(TASK_TOKENS)},
    THINK_START: 128821,
    THINK_END: 128822,
    IMAGE_TOKEN: 129264,
}

RESERVED_FMT = "<｜place▁holder▁no▁{}｜>"
TINY_BPE_VOCAB = 1000  # trainer target for a small tokenizer (incl. BOS/EOS/PAD)
LARGE_BPE_VOCAB = 4096  # trainer target when the vocabulary is fixed and large
VOCAB_MULTIPLE = 64

# A DeepSeek-style Jinja chat template (non-thinking unless `thinking` /
# `enable_thinking` is passed; `reasoning_effort` as in the V4.1 encoder), so
# plain `apply_chat_template` and vLLM's default tokenizer mode produce the
# same prompt as the V4.1 encoder for plain system/user/assistant text
# conversations (no tools, tasks or images).
CHAT_TEMPLATE = (
    "{%- set thinking = thinking is defined and thinking or enable_thinking is defined and enable_thinking -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' or m['role'] == 'developer' or (m['role'] == 'system' and not loop.first) -%}"
    "{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else 'high' -%}"
    "{%- set effort = {'low': 50, 'high': 75, 'xhigh': 75, 'max': 100}[effort] if effort is string else effort -%}"
    "{{- bos_token -}}"
    "{%- if thinking -%}"
    "{{- '<｜System｜>Reasoning Effort: ' + effort | string + ' (range 1-100, the higher the value, "
    "the more thorough the reasoning)\n\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'system' -%}"
    "{{- ('' if loop.first and thinking else '<｜System｜>') + content -}}"
    "{%- elif m['role'] == 'user' or m['role'] == 'developer' -%}"
    "{{- '<｜User｜>' + content -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if thinking and loop.index0 > ns.last_user -%}"
    "{{- (m['reasoning_content'] if m['reasoning_content'] is defined and m['reasoning_content'] else '') + '</think>' -}}"
    "{%- endif -%}"
    "{{- content + '<｜end▁of▁sentence｜>' -}}"
    "{%- endif -%}"
    "{%- set user_like = m['role'] == 'user' or m['role'] == 'developer' or (m['role'] == 'system' and not loop.first) -%}"
    "{%- if user_like and ((not loop.last and loop.nextitem['role'] == 'assistant') or (loop.last and add_generation_prompt)) -%}"
    "{{- '<｜Assistant｜>' + ('<think>' if thinking and loop.index0 >= ns.last_user else '</think>') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Built-in training text: varied English (prose, dialogue, lists, numbers,
# code-ish lines) with accented, capitalised and upper-case variants so the
# Engram normaliser merges some tokens, plus a little non-Latin script so some
# byte-fragment tokens exist.
CORPUS = """\
The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his little boat, and every evening he came back with fish.
One day he caught a golden fish that could speak. "Please let me go," said the fish,
"and I will give you anything you wish for." The old man was kind, so he let it go.
When he told his wife, she was angry. "Go back and ask for a new house!" she said.

Good morning! How are you today? I am fine, thank you. And you? Not bad at all.
What time is it? It is half past nine. We should leave soon, or we will be late.
Where are you going? I am going to the library to read a book about history.
Would you like a cup of coffee or tea? Coffee, please, with a little milk and no sugar.
Yes. No. Maybe. Of course. Thank you very much. You are welcome. See you tomorrow.

We met at a small café in Paris. The café was full, so we sat outside. Café au lait is my
favourite drink; my friend ordered a crème brûlée and a croissant. Her résumé lists three
languages, and she has lived in Zürich, São Paulo and Kraków. It was a naïve idea to visit
every museum in one day, but the façade of the old opera house was worth the walk. We ate a
jalapeño pizza, talked about déjà vu, and measured the light in ångström units for fun.
CAFE, Cafe, café and Café are the same word to a careful reader; so are NAIVE and naïve.

Science is the patient study of the natural world. A scientist asks a question, makes a
guess, and then tests the guess with an experiment. If the result does not match, the guess
is wrong, and a new one is needed. Water boils at 100 degrees Celsius at sea level and
freezes at 0 degrees. The speed of light is about 299,792 kilometres per second. The Earth
goes around the Sun once every 365.25 days, and the Moon goes around the Earth in about
27 days. Plants use sunlight, water and carbon dioxide to make sugar and oxygen.

History is full of surprises. The Roman Empire lasted for many centuries, and its roads,
laws and languages shaped much of Europe. The printing press, invented in the fifteenth
century, made books cheap and spread new ideas quickly. In the nineteenth century, steam
engines and railways changed how people worked and travelled. In the twentieth century,
computers and the internet changed how people talk, learn and share information.

A computer program is a list of instructions. For example:
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, 1))
if x > 0 and y < 10:
    result = [x, y, x * y]
The function returns the sum of its two arguments. Variables hold values; loops repeat work;
conditions choose between paths. Good code is simple, clear and well tested.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 64 99 100 128 256 512 1000 1024 2048 4096 2025.
Lists: apples, oranges, bananas, grapes, lemons, cherries and pears. Red, green, blue, yellow,
black, white, purple and orange. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: What is two plus two? Answer: Two plus two is four.
Question: Who wrote Hamlet? Answer: William Shakespeare wrote Hamlet.
Question: Why is the sky blue? Answer: Sunlight is scattered by the air, and blue light is
scattered more than red light, so the sky looks blue during the day.

The weather today is sunny and warm, with a light wind from the west. Tomorrow it will be
cloudy, and there may be rain in the evening. Please remember to take an umbrella. In winter
the days are short and cold; in summer they are long and hot. Spring brings flowers, and
autumn brings falling leaves of red and gold.

Dear team, thank you for your hard work this week. The report is finished, the tests pass,
and the new version is ready. Please read the notes below before the meeting on Friday.
NOTE: the server will be offline on Sunday morning for maintenance. IMPORTANT: save your work.
Best regards, Anna.

She said, "I think we can do it." He answered, "Let us try, then." They worked all night,
and when the sun came up, the bridge was finished. Everyone cheered. The children ran across
it, laughing, and the old people watched from the river bank with tears in their eyes.

Greek: λόγος, φιλοσοφία. Russian: привет, мир. Chinese: 你好，世界。 Japanese: こんにちは。
Emoji and symbols: ★ → ← ✓ © ® ° ± × ÷ € £ ¥ § ¶ … — – " " ' '.

In the end, learning is a journey rather than a destination. Read widely, ask questions,
make mistakes, and keep going. Small steps every day add up to great distances over time.
"""


@dataclass(frozen=True)
class TokenizerInfo:
    """What :func:`build_tokenizer` wrote."""

    path: str
    vocab_size: int  # number of ids (= len(tokenizer))
    bos_id: int
    eos_id: int
    pad_id: int
    noise_id: int
    image_id: int
    user_id: int
    assistant_id: int
    think_start_id: int
    think_end_id: int
    bpe_size: int  # ids [0, bpe_size) are BOS/EOS/PAD + the trained BPE
    special_ids: dict = field(default_factory=dict)  # token -> id for every chat/special token


def _train_bpe(target: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per training "sentence": keeps word counts independent of how
    # the text is chunked, and the trainer's merge order is deterministic.
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def build_tokenizer(vocab_size: int | None, out_dir: str | os.PathLike, *,
                    bpe_vocab_size: int | None = None, model_max_length: int = 1048576) -> TokenizerInfo:
    """Write the tokenizer files into ``out_dir`` and describe the id layout.

    ``vocab_size=None`` sizes the vocabulary to BPE + specials rounded up to a
    multiple of 64 (~1024 ids).  A given ``vocab_size`` is filled with
    reserved placeholders; from 129,280 up the special tokens take their
    official ids, below that they sit at the top of the vocabulary.
    """
    from tokenizers import Tokenizer

    n_chat = len(CHAT_TOKENS)
    if bpe_vocab_size is None:
        bpe_vocab_size = TINY_BPE_VOCAB if vocab_size is None else min(
            LARGE_BPE_VOCAB, max(256 + 3, vocab_size - n_chat))
    tok = _train_bpe(bpe_vocab_size)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    bpe_size = len(vocab)
    assert sorted(vocab.values()) == list(range(bpe_size))
    assert vocab[BOS_TOKEN] == 0 and vocab[EOS_TOKEN] == 1 and vocab[PAD_TOKEN] == 2

    official = vocab_size is not None and vocab_size >= OFFICIAL_VOCAB_SIZE
    if vocab_size is None:
        vocab_size = _round_up(bpe_size + n_chat, VOCAB_MULTIPLE)
    if vocab_size < bpe_size + n_chat:
        raise ValueError(f"vocab_size {vocab_size} cannot hold {bpe_size} BPE ids and {n_chat} special tokens")
    if official:
        placed = dict(OFFICIAL_IDS)
        if min(placed.values()) < bpe_size:
            raise ValueError(f"BPE part ({bpe_size}) overlaps the official special ids")
    else:
        top = vocab_size - n_chat
        placed = {t: top + i for i, (t, _) in enumerate(CHAT_TOKENS)}

    by_id: dict[int, str] = {i: t for t, i in placed.items()}
    for i in range(bpe_size, vocab_size):
        tok_str = by_id.get(i)
        vocab[tok_str if tok_str is not None else RESERVED_FMT.format(i)] = i

    special_flag = dict(CHAT_TOKENS)
    added = [(0, BOS_TOKEN, True), (1, EOS_TOKEN, True), (2, PAD_TOKEN, True)]
    added += sorted((i, t, special_flag[t]) for t, i in placed.items())
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": sp}
        for i, t, sp in added
    ]
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [0], "tokens": [BOS_TOKEN]}},
    }
    final = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    if final.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"tokenizer has {final.get_vocab_size(with_added_tokens=True)} ids, "
                             f"expected {vocab_size}")

    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    final.save(os.path.join(out, "tokenizer.json"), pretty=False)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": int(model_max_length),
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, ensure_ascii=False, indent=2)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, f,
                  ensure_ascii=False, indent=2)
        f.write("\n")

    return TokenizerInfo(
        path=out,
        vocab_size=vocab_size,
        bos_id=0,
        eos_id=1,
        pad_id=2,
        noise_id=placed[NOISE_TOKEN],
        image_id=placed[IMAGE_TOKEN],
        user_id=placed[USER_TOKEN],
        assistant_id=placed[ASSISTANT_TOKEN],
        think_start_id=placed[THINK_START],
        think_end_id=placed[THINK_END],
        bpe_size=bpe_size,
        special_ids={BOS_TOKEN: 0, EOS_TOKEN: 1, PAD_TOKEN: 2, **placed},
    )


__all__ = ["build_tokenizer", "TokenizerInfo", "CHAT_TEMPLATE", "CORPUS", "BOS_TOKEN", "EOS_TOKEN",
           "PAD_TOKEN", "NOISE_TOKEN", "OFFICIAL_IDS", "OFFICIAL_VOCAB_SIZE"]
