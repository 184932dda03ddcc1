"""The text-to-text prompts of the FLAN-T5-base GLUE eight-task benchmark: per task, the input template (its `{field}`s
are the GLUE row's columns) and the answer word of each class in label-id order (STS-B: its score formatted to one
decimal). Data, not code: FusionBench's (tanganke/fusion_bench,
fusion_bench/tasks/flan_t5_text_generation/glue_prompt_templates.py), the prompts the `tanganke/flan-t5-base_glue-*`
experts were fine-tuned on, kept word for word, their spelling ("Answere") included, since the experts answer to
these exact strings."""

from __future__ import annotations

TEMPLATES: dict[str, str] = {
    "cola": "Indicate if the following sentence is grammatically correct or not: \"{sentence}\". Answere 'acceptable' "
            "or 'unacceptable'.",
    "mnli": "Does the premise: '{premise}' logically imply, contradict, or is neutral to the hypothesis: "
            "'{hypothesis}'? Answere with 'entailment', 'contradiction', or 'neutral'.",
    "mrpc": "Are the following sentences '{sentence1}' and '{sentence2}' conveying the same meaning? Answere with "
            "'yes' or 'no'.",
    "qnli": "Given the context: '{sentence}', does the question '{question}' have an answer based on the information "
            "provided? Answer with 'yes' or 'no'.",
    "qqp": "Do the questions '{question1}' and '{question2}' have the same intent? Answere with 'yes' or 'no'.",
    "rte": "Does the text: '{sentence1}' entail that '{sentence2}' is true? Provide 'yes' or 'no'.",
    "sst2": "Given the sentence '{sentence}', determine the sentiment. Is it positive or negative?",
    "stsb": "Consider the sentences '{sentence1}' and '{sentence2}'. On a scale from 1 (completely different) to 5 "
            "(completely similar), rate the similarity.",
}

# GLUE's label ids → the word the expert answers; qnli's and rte's 0 is (not_)entailment's "yes".
LABEL_WORDS: dict[str, list[str]] = {
    "cola": ["unacceptable", "acceptable"],
    "mnli": ["entailment", "neutral", "contradiction"],
    "mrpc": ["no", "yes"],
    "qnli": ["yes", "no"],
    "qqp": ["no", "yes"],
    "rte": ["yes", "no"],
    "sst2": ["negative", "positive"],
}

SCORE_FORMAT = "{:.1f}"  # STS-B's target text: its 0–5 similarity score
