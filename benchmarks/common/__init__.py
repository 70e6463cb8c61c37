"""What every group of benchmarks shares: the models and workloads, the engine builder, the step-clock engine run,
the arithmetic, the streaming OpenAI client, the Serve processes' view and the report (tables, JSON, figures)."""
