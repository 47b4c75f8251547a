"""Local tokenizers for generated models: byte-level BPE trained on a few sentences, plus the
special tokens and chat templates each model family expects (no hub download needed)."""

from __future__ import annotations

from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A key-value cache stores the keys and values of every token the model has seen.",
    "Rotary position embeddings rotate pairs of features by an angle that grows with position.",
    "Moving a cached chunk to a new position is one more rotation by the difference.",
    "Describe the image. What is in the picture? Compare the two images and answer briefly.",
    "User: hello there! Assistant: hi, how can I help you today?",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000, - + = ( ) [ ] { } < > / \\ | : ; ' \" ? !",
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ IMAGE }}{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IDEFICS3_CHAT = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}"
    "{% if m['content'] is string %}: {{ m['content'] }}{% else %}"
    "{% if m['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

BASE_SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
QWEN2VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IDEFICS3_SPECIALS = (
    ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
)


def train_tokenizer(extra_specials: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = BASE_SPECIALS + extra_specials
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=extra_specials,
    )


def token_ids(tok: Any) -> dict[str, int]:
    return {
        "bos_token_id": tok.convert_tokens_to_ids("<s>"),
        "eos_token_id": tok.convert_tokens_to_ids("</s>"),
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
    }
