"""MegaTier: a 3D-parallel GPT trainer with tiered checkpointing."""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch==2.13.0",
    "hydra-core>=1.3,<1.4",
    "omegaconf>=2.3,<2.4",
    "wandb>=0.17",
    "numpy>=1.24",
    "safetensors>=0.4",
    "xxhash>=3.0",
    "fsspec>=2023.1",
    "boto3>=1.28",
    "tqdm>=4.60",
    "tokenizers>=0.15",
]

EXTRAS = {
    "dev": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "pytest-xdist>=3.3",
        "hypothesis>=6",
        "boto3>=1.28",
        "moto[server]>=5",
    ],
    "gpu": ["transformer-engine"],
}

setup(
    name="megatier",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT trainer with tiered checkpointing",
    packages=find_packages(include=["megatier", "megatier.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
