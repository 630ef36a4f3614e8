# pagefleet's image: Ray's base image, at the Ray version pyproject.toml pins, with pagefleet
# installed from this checkout (`pip install .`). helm/pagefleet/README.md says how to build it
# and push it.
#
#   docker build -t REGISTRY/pagefleet:0.1.0 .                      # CPU
#   docker build -t REGISTRY/pagefleet:0.1.0-cuda \
#     --build-arg RAY_IMAGE_SUFFIX=-gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA

ARG RAY_VERSION=2.60.0
# "" for Ray's CPU image; "-gpu" (Ray's default CUDA) or a CUDA tag such as "-cu128".
ARG RAY_IMAGE_SUFFIX=""
FROM rayproject/ray:${RAY_VERSION}-py311${RAY_IMAGE_SUFFIX}

# A C compiler: inductor builds the compiled forward with it at start-up, and the CPU
# attention kernels (pagefleet/kernels/cpu_paged_decode.c, cpu_paged_prefill.c) are built with it on
# first use.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# Back to Ray's user (as the base image has it) for the install below.
USER 1000:100

# Where pip looks for torch==2.13.0 besides PyPI. The CPU wheels by default: PyPI's Linux
# wheel bundles CUDA libraries a CPU image would carry for nothing.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /home/ray/pagefleet
# What `pip install .` builds: the one package folder (pyproject.toml's packages) and the readme.
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users pagefleet ./pagefleet
# Import the Serve application once so that a broken install fails the build, not the pods.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" . \
    && python -c "import pagefleet.cluster.app"
WORKDIR /home/ray
# Ray's user (`ray`, uid 1000, group `users`, gid 100), by number: Kubernetes can then check
# runAsNonRoot without a runAsUser. The chart's podSecurityContext runs every pod as the same.
USER 1000:100
