"""`trellis demo economics`: Azure's LLM demand through pooled composition and fixed GPU boxes.

- data.py: the hall, the trace and the example scheduler the demo runs with;
- workload.py: the trace's requests, as compose work;
- runs.py: the two runs through a real engine, and the storm;
- figures.py: each run's figures, from its log;
- plots.py / live.py: the PNG plots, and the progress view while it runs;
- demo.py: the whole demo, as the CLI runs it.
"""
