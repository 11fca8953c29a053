"""The engine room: everything the algorithm scripts share that is not algorithm logic. Loading models and data,
sampling and scoring rollouts (HF generate or vLLM, multi-turn tools, a sampler running ahead), rewards, the
optimizer step, checkpoints, logging and the run folder, and the shared flag groups each script's `Args` mixes in.
A researcher copies a script at the root and changes its ALGO LOGIC; nothing here needs to change for that.
Imports run one way: the scripts import policy_common and this package; nothing here imports a script."""
