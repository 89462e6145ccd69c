set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, torchvision; print(torch.__version__, torch.version.cuda, torchvision.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# 1. The old template applied channels_last to every input: a 3-D batch fails on the GPU.
python3 -c "import torch; torch.zeros(2,5,3,device='cuda').contiguous(memory_format=torch.channels_last)" 2>&1 | tail -1
# 2. The template, its defaults on an H100: bf16, channels_last, cudnn.benchmark, pinned memory.
cd examples/generic/template
python3 main.py --synthetic-data --synthetic-size 6000 --synthetic-classes 10 --model resnet18 --image-size 64 --batch-size 64 --accumulation-steps 2 --epochs 2 --warmup-steps 5 --log-every 10 --num-workers 4 --checkpoint-dir /tmp/ck1 2>&1 | tail -12
# 3. A sequence model swapped into the template's reader section, same defaults.
cd ../../../gpucheck/sequences
python3 main.py --synthetic-data --synthetic-size 6000 --batch-size 64 --accumulation-steps 2 --epochs 2 --warmup-steps 5 --log-every 20 --num-workers 2 --checkpoint-dir /tmp/ck2 2>&1 | tail -8
# 4. torch.compile on the GPU, and torchrun with one process.
cd ../../examples/generic/template
python3 -m torch.distributed.run --standalone --nproc-per-node=1 main.py --synthetic-data --synthetic-size 3000 --synthetic-classes 10 --model resnet18 --image-size 64 --batch-size 64 --epochs 1 --warmup-steps 5 --log-every 10 --num-workers 4 --compile --checkpoint-dir /tmp/ck3 2>&1 | tail -6
# 5. mp.spawn with one process per GPU.
cd ../../launchers/mp_spawn
python3 main.py --synthetic-data --synthetic-size 3000 --synthetic-classes 10 --model resnet18 --image-size 64 --batch-size 64 --epochs 1 --warmup-steps 5 --log-every 10 --num-workers 4 2>&1 | tail -3
# 6. The speed table: ResNet-50, 224 px, synthetic images.
cd ../../..
python3 tests/bench.py --steps 30 --csv $OUT/bench.csv 2>$OUT/bench.err | tee $OUT/bench.md
