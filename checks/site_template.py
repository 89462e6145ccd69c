# The site file: what ReFrame needs to know about your cluster to run the checks of
# checks/examples.py. Copy it (`cp checks/site_template.py site.py`), change the lines
# marked EDIT, and run `reframe -C site.py -c checks/ -r`. The format is ReFrame's
# configuration file: https://reframe-hpc.readthedocs.io/en/stable/config_reference.html

site_configuration = {
    "systems": [
        {
            "name": "mycluster",  # EDIT: any name; it heads the report and perf logs
            "descr": "GPU nodes of my cluster",  # free text, for whoever reads this
            # ReFrame uses this system on machines whose name matches one of these
            # regular expressions. Keep ".*" unless one file describes several clusters.
            "hostnames": [".*"],
            # The checks load no modules: each job.sh loads its own.
            "modules_system": "nomod",
            "partitions": [
                {
                    "name": "gpu",  # any name
                    "descr": "nodes with GPUs",  # free text
                    # EDIT: "slurm" asks Slurm's accounting (sacct) for each job's
                    # state: keep it where `sacct` works on the login node. "squeue"
                    # asks squeue only, for a cluster without accounting.
                    "scheduler": "slurm",
                    # ReFrame needs one. job.sh starts its own processes (srun,
                    # torchrun): the checks run it with "local" whatever this says.
                    "launcher": "local",
                    # EDIT: sbatch options every GPU job needs here, without "#SBATCH".
                    # They come before job.sh's own #SBATCH lines: where both set one
                    # option, job.sh's wins.
                    "access": ["--partition=gpu", "--account=my-project"],
                    # The names of the environments below.
                    "environs": ["ddp"],
                    # How many check jobs may be queued or running at once.
                    "max_jobs": 4,
                    "extras": {
                        # EDIT after a first run: NCCL's name for the network between
                        # the nodes, the word after `via NET/` in the fabric check's
                        # output (IB for InfiniBand and RoCE). The fabric check then
                        # fails where NCCL used another. "" checks nothing.
                        "ddp_nccl_network": "",
                        # EDIT after a first run: per example, its expected speed, as
                        # (value, lowest change, highest change, unit). The changes are
                        # fractions; None is no limit. For example,
                        # "generic/template": {"samples_per_s_per_gpu":
                        #     (1000, -0.1, None, "samples/s")}
                        # fails that check below 900 samples/s per GPU, and
                        # "generic/fabric": {"busbw": (40, -0.2, None, "GB/s")}
                        # fails the fabric check below 32 GB/s. {}: speeds are logged,
                        # never judged.
                        "ddp_references": {},
                        # Only where an example's default short run does not suit the
                        # cluster (checks/examples.py: SHORT_RUNS). Key: an example
                        # ("generic/fsdp") or a folder ("generic"). "args" replace the
                        # defaults; "val_samples" is the size of the validation set
                        # they make (left out: not checked); "ranks", the processes
                        # they start, where not one per GPU of job.sh; and
                        # "losses_logged", the fewest log lines with the loss (2).
                        "ddp_runs": {},
                    },
                },
            ],
        }
    ],
    "environments": [
        {
            "name": "ddp",  # the name that "environs" above lists
            # EDIT: the examples to run: ddp-generic for examples/generic and
            # examples/launchers; add ddp-mila or ddp-ibex on those clusters only.
            "features": ["ddp-generic"],
            # EDIT: variables the jobs need that your login shell does not set, such
            # as SCRATCH where job.sh reads it. job.sh activates its own Python.
            "env_vars": [],
        }
    ],
}
