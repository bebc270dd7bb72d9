"""The model's tokenizer inside the router pod, so the router keys prefixes exactly as the engines do.

Where the files come from, in order (pure; `router_tokenizer`):
1. `spec.router.tokenizer`: a directory the router image already has (a custom image).
2. A Hugging Face model id (`spec.model.tokenizer`, else `spec.model.name`): an init container of
   the engine image (which has Python and huggingface_hub) downloads only the tokenizer files into
   an emptyDir, with the `hfTokenSecret` token for gated models.
3. A path on the model volume (`spec.model.cache`): the claim is mounted read-only in the router
   pod at the engines' mount path (the claim must allow a second reader: ReadOnlyMany,
   ReadWriteMany, or the same node).
Otherwise (a path baked into the engine image) the router keys prefixes by its approximation, and
the ServingCluster says so: condition ExactTokenization=False and a Warning Event.

The engines' own chat-template override (vLLM's `--chat-template`, a file or the template text, and
`--default-chat-template-kwargs`, in the decode pool's arguments) reaches the router too: the text
as it is, a file when it lies on the model volume the router mounts. A file the router cannot read
makes chat keys approximate, and the status says so the same way.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from tandem.common.chat_template import is_template_text
from tandem.operator.api import ServingCluster
from tandem.operator.common_render import last_flag

TOKENIZER_DIR = "/var/lib/tandem/tokenizer"
TOKENIZER_VOLUME = "tokenizer"
MODEL_VOLUME = "model-cache"
FETCH_CONTAINER = "fetch-tokenizer"
# Only what tokenizing and chat templates read: no weights.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "config.json",
    "generation_config.json",
)
# argv: repo id, revision ("" for the default branch), target directory, file patterns...
FETCH_SCRIPT = (
    "import sys; from huggingface_hub import snapshot_download; "
    "snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3], "
    "allow_patterns=sys.argv[4:]); print('tokenizer files of', sys.argv[1], 'in', sys.argv[3])"
)


@dataclass(frozen=True)
class TokenizerSource:
    """How the router pod gets the tokenizer: `path` is its directory there (None: no tokenizer);
    `chat_template` the engines' override as the router reads it (None: the model's own)."""

    kind: Literal["configured", "hub", "volume", "none"]
    path: str | None
    message: str
    chat_template: str | None = None
    chat_template_readable: bool = True

    @property
    def exact(self) -> bool:
        return self.path is not None and self.chat_template_readable


def engine_chat_template(sc: ServingCluster) -> tuple[str | None, dict[str, Any]]:
    """The decode engines' `--chat-template` and `--default-chat-template-kwargs` (decode answers
    chat requests, and prefill renders them the same way)."""
    args = sc.spec.engine.extra_args + sc.spec.decode.extra_args
    kwargs_text = last_flag(args, "--default-chat-template-kwargs")
    kwargs: dict[str, Any] = {}
    if kwargs_text is not None:
        try:
            kwargs = json.loads(kwargs_text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from exc
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object")
    return last_flag(args, "--chat-template"), kwargs


def _is_hub_id(name: str) -> bool:
    """`org/model` or `model`, as opposed to a filesystem path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1


def router_tokenizer(sc: ServingCluster) -> TokenizerSource:
    source = _tokenizer_files(sc)
    template, _ = engine_chat_template(sc)
    if template is None or is_template_text(template):
        return dataclasses.replace(source, chat_template=template)
    cache = sc.spec.model.cache
    if (
        source.kind == "volume"
        and cache
        and template.startswith(cache.mount_path.rstrip("/") + "/")
    ):
        return dataclasses.replace(source, chat_template=template)
    return dataclasses.replace(
        source,
        chat_template_readable=False,
        message=f"{source.message}; the engines' --chat-template file {template} is not in the "
        "router pod, so chat prompts are keyed by the model's own template: give the template "
        "text itself in extraArgs, or put the file on spec.model.cache beside the tokenizer",
    )


def _tokenizer_files(sc: ServingCluster) -> TokenizerSource:
    spec = sc.spec
    if spec.router.tokenizer:
        return TokenizerSource(
            "configured", spec.router.tokenizer, f"router.tokenizer: {spec.router.tokenizer}"
        )
    name = spec.model.tokenizer or spec.model.name
    if _is_hub_id(name):
        return TokenizerSource(
            "hub",
            TOKENIZER_DIR,
            f"tokenizer files of {name} fetched from the Hugging Face Hub by the router pod's "
            f"{FETCH_CONTAINER} init container",
        )
    cache = spec.model.cache
    if cache and name.startswith(cache.mount_path.rstrip("/") + "/"):
        return TokenizerSource(
            "volume", name, f"{name} on the model volume {cache.pvc}, mounted read-only"
        )
    return TokenizerSource(
        "none",
        None,
        f"the tokenizer at {name} is inside the engine image and no volume holds it for the "
        "router, which keys prefixes by its approximation: put the model on spec.model.cache, "
        "name a Hugging Face model, or set spec.router.tokenizer to a directory in the router image",
    )


def tokenizer_pod_parts(
    sc: ServingCluster, security_context: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(init containers, volumes, router volume mounts) that put the tokenizer in the router pod."""
    source = router_tokenizer(sc)
    spec = sc.spec
    if source.kind == "hub":
        name = spec.model.tokenizer or spec.model.name
        revision = spec.model.revision if not spec.model.tokenizer else None
        env: list[dict[str, Any]] = [
            # The download cache goes beside the files: the root filesystem is read-only.
            {"name": "HF_HOME", "value": f"{TOKENIZER_DIR}/.cache"},
            {"name": "HOME", "value": TOKENIZER_DIR},
        ]
        if spec.model.hf_token_secret:
            ref = spec.model.hf_token_secret
            env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
        fetch = {
            "name": FETCH_CONTAINER,
            "image": spec.engine.image,
            "imagePullPolicy": spec.engine.image_pull_policy,
            "command": ["python3", "-c", FETCH_SCRIPT],
            "args": [name, revision or "", TOKENIZER_DIR, *TOKENIZER_FILES],
            "env": env,
            "resources": {
                "requests": {"cpu": "100m", "memory": "256Mi"},
                "limits": {"memory": "1Gi"},
            },
            "volumeMounts": [{"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR}],
            "securityContext": security_context,
        }
        volume = {"name": TOKENIZER_VOLUME, "emptyDir": {"sizeLimit": "1Gi"}}
        mount = {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR, "readOnly": True}
        return [fetch], [volume], [mount]
    if source.kind == "volume" and spec.model.cache:
        cache = spec.model.cache
        volume = {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": cache.pvc, "readOnly": True},
        }
        mount = {"name": MODEL_VOLUME, "mountPath": cache.mount_path, "readOnly": True}
        if cache.sub_path:
            mount["subPath"] = cache.sub_path
        return [], [volume], [mount]
    return [], [], []
