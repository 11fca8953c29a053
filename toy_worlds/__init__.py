"""The toy worlds: small tasks built offline on a CPU in about a minute, so that every script trains and is tested
without a model hub. toy_task.py builds the letter-sorting worlds `toy` and `toy_hard` (an SFT policy, a reward model,
preference and unpaired data) and their teacher for distillation; toy_tools.py builds the tool world `toy_tools`
(multi-turn episodes with a lookup tool). They import no other project module."""
