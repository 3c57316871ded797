"""What shapes a reply's tokens: grammars for structured output and tools, JSON bounds, stop strings,
OpenAI's sampling adjustments, logprobs, prompts that miss their <bos>."""
