"""What a job is: model presets (GPT, LLaMA, MoE, Hugging Face), spec files,
and what they share."""
