# The site file: what ReFrame needs to know about your cluster to run the checks of
# checks/examples.py. Copy it (`cp checks/site_template.py site.py`), change the lines
# marked EDIT, and run `reframe -C site.py -c checks/ -r`. The format is ReFrame's
# configuration file: https://reframe-hpc.readthedocs.io/en/stable/config_reference.html

site_configuration = {
    "systems": [
        {
            "name": "mycluster",  # EDIT: any name; it heads the report and perf logs
            "descr": "GPU nodes of my cluster",
            # EDIT: the names of the login nodes you run reframe on, as regular
            # expressions. ".*" takes any machine.
            "hostnames": [".*"],
            # EDIT: "lmod" or "tmod4" where the site has modules, "nomod" otherwise.
            # The checks load none themselves: job.sh does, as the reader's does.
            "modules_system": "nomod",
            "partitions": [
                {
                    "name": "gpu",  # EDIT: any name
                    "descr": "nodes with GPUs",
                    # "slurm" asks sacct for the state of the jobs; "squeue" only asks
                    # squeue, for a cluster without Slurm's accounting database.
                    "scheduler": "slurm",
                    # job.sh starts its processes itself (srun, torchrun): each check
                    # runs it with the local launcher, whatever this says.
                    "launcher": "local",
                    # EDIT: #SBATCH lines of the site, added before job.sh's own.
                    "access": ["--partition=gpu", "--account=my-project"],
                    "environs": ["ddp"],
                    # How many checks may wait in the queue at once.
                    "max_jobs": 4,
                    "extras": {
                        # EDIT: NCCL's name for the network between the nodes (as
                        # NCCL_DEBUG=INFO prints it in `via NET/IB/...` lines): the
                        # fabric check fails where it used another. "" checks nothing.
                        "ddp_nccl_network": "IB",
                        # EDIT: per example, the speed below which its check fails:
                        # (value, lowest fraction below it, highest above, unit). Start
                        # with the numbers of a first run you trust.
                        "ddp_references": {
                            "generic/template": {
                                "samples_per_s_per_gpu": (1000, -0.1, None, "samples/s")
                            },
                            "generic/fabric": {"busbw": (40, -0.2, None, "GB/s")},
                        },
                        # Other arguments for an example's short run, with the size
                        # of the validation set they make, the number of processes
                        # they start and the fewest times they log the loss
                        # (checks/examples.py: SHORT_RUNS), for example:
                        # "ddp_runs": {"generic/fsdp": {"args": [...],
                        #     "val_samples": 819, "ranks": 8, "losses_logged": 2}},
                    },
                },
            ],
        }
    ],
    "environments": [
        {
            "name": "ddp",
            # The examples this environment serves: ddp-generic for examples/generic
            # and examples/launchers; ddp-mila and ddp-ibex for those clusters'.
            "features": ["ddp-generic"],
            # EDIT: variables the jobs need that the login shell does not set, such
            # as SCRATCH where job.sh reads it. job.sh activates its own environment.
            "env_vars": [["OMP_NUM_THREADS", "1"]],
        }
    ],
}
