#!/bin/bash
# One vLLM generation node + (N - 1) training nodes (docs/vllm_and_async.md, "Generation on vLLM's own server").
# sbatch --nodes 3 configs/slurm_vllm_server.sh rloo.py --model pythia-1b
#SBATCH --job-name=rlhf-vllm-server
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
SCRIPT=$1; shift
MODEL=${MODEL:-EleutherAI/pythia-1b}  # the model vllm serve loads: the one --model names
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
GEN_NODE=${NODES[0]}
TRAIN_NODES=$((SLURM_NNODES - 1))
GPUS=${SLURM_GPUS_PER_NODE:-8}

# the stock server on the first node: one replica per GPU, weights over NCCL
srun --nodes 1 --ntasks 1 -w "$GEN_NODE" env VLLM_SERVER_DEV_MODE=1 vllm serve "$MODEL" --port 8000 \
    --data-parallel-size "$GPUS" --logprobs-mode processed_logprobs --max-logprobs -1 \
    --weight-transfer-config '{"backend": "nccl"}' &

# the trainers on the others: DeepSpeed ZeRO-3 over all their GPUs (the scripts wait for the server to come up)
MAIN=${NODES[1]}
srun --nodes "$TRAIN_NODES" --ntasks "$TRAIN_NODES" -x "$GEN_NODE" bash -c "accelerate launch \
    --config_file configs/deepspeed_zero3.yaml --num_machines $TRAIN_NODES --num_processes $((TRAIN_NODES * GPUS)) \
    --machine_rank \$SLURM_PROCID --main_process_ip $MAIN --main_process_port 29500 \
    $SCRIPT --use_vllm --vllm_mode server --vllm_server_base_url http://$GEN_NODE:8000 $*"
