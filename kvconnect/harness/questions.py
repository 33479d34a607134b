"""A small question set for the real model (kvconnect.harness.real_model): the task-level check of P/D.

Each question goes through the chat template, answered greedily; a P/D pair passes when every answer equals
the aggregated server's token for token (a wrong KV cache changes answers long before it makes them
nonsense). `expect`, where given, is a word the 135M model's answer contains when it is served correctly,
so that a reader also sees answers that make sense. Written for this project; short factual questions,
a little arithmetic in the spirit of GSM8K, and prompts of a few hundred tokens so that the KV spans blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOKENS = 48


@dataclass(frozen=True)
class Question:
    text: str
    expect: str = ""  # a word the correct answer contains ("" where the small model is not reliable)


_CONTEXT = (
    "Disaggregated serving runs the prefill of a prompt on one server and the decoding of its answer on "
    "another. The prefill server computes the key-value cache of the prompt; the decode server reads that "
    "cache over the network and continues from it, token by token. "
)

QUESTIONS: tuple[Question, ...] = (
    Question("What is the capital of France?", "Paris"),
    Question("What is the capital of Japan?", "Tokyo"),
    Question("Which planet is known as the Red Planet?", "Mars"),
    Question("What is the chemical symbol for water?", "H"),
    Question("How many days are there in a week?", "7"),
    Question("Who wrote the play Romeo and Juliet?", "Shakespeare"),
    Question("Name the largest ocean on Earth.", "Pacific"),
    Question("Tom has 3 apples and buys 4 more. How many apples does he have now?"),
    Question("A train travels 60 kilometres in one hour. How far does it travel in 3 hours?"),
    Question("Write a haiku about the sea."),
    Question(_CONTEXT * 3 + "In one sentence: which server computes the key-value cache?", "prefill"),
    Question(_CONTEXT * 6 + "Summarize the text above in one sentence."),
)
