{{/* Names: the release name, plus "-pagefleet" unless it already says so (63 characters). */}}
{{- define "pagefleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagefleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of the chart's own objects. */}}
{{- define "pagefleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "pagefleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels of the Ray pods. KubeRay labels its pods app.kubernetes.io/name=kuberay; that stays, and
the pods are told apart by instance, part-of and component instead.
*/}}
{{- define "pagefleet.podSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "pagefleet.name" . }}
{{- end }}

{{- define "pagefleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* True (non-empty) when the engine runs on CUDA: worker pods then get GPUs. */}}
{{- define "pagefleet.gpu" -}}
{{- $device := default "cpu" (.Values.config.engine | default dict).device }}
{{- if hasPrefix "cuda" $device }}true{{ end }}
{{- end }}

{{- define "pagefleet.tensorParallelSize" -}}
{{- int (default 1 (.Values.config.engine | default dict).tensor_parallel_size) }}
{{- end }}

{{/* True when something fills config.model on a volume (so the volume is mounted). */}}
{{- define "pagefleet.modelVolume" -}}
{{- if or .Values.modelSource.huggingFace.repo .Values.modelSource.pvc.claimName .Values.config.make_model }}true{{ end }}
{{- end }}

{{/*
Cross-field checks that a JSON schema cannot express. Each failure names the field to change.
*/}}
{{- define "pagefleet.validate" -}}
{{- $c := .Values.config }}
{{- $src := .Values.modelSource }}
{{- $engine := $c.engine | default dict }}
{{- $res := $c.replica_resources | default dict }}
{{- $tp := int (include "pagefleet.tensorParallelSize" .) }}
{{- $gpus := float64 (default 0 $res.num_gpus) }}
{{- $cpus := float64 (ternary 1 $res.num_cpus (kindIs "invalid" $res.num_cpus)) }}
{{- if and $src.huggingFace.repo $c.make_model }}
{{- fail "modelSource.huggingFace.repo and config.make_model both fill config.model: set one of them" }}
{{- end }}
{{- if include "pagefleet.modelVolume" . }}
{{- $mount := trimSuffix "/" $src.mountPath }}
{{- if not (hasPrefix (printf "%s/" $mount) $c.model) }}
{{- fail (printf "config.model (%s) must lie under modelSource.mountPath (%s), where the models volume is mounted" $c.model $src.mountPath) }}
{{- end }}
{{- end }}
{{- if include "pagefleet.gpu" . }}
{{- if ne $gpus 1.0 }}
{{- fail (printf "config.replica_resources.num_gpus (%v) must be 1 on %s: it is per rank, and each worker pod gets config.engine.tensor_parallel_size (%d) GPUs, one per rank" $gpus $engine.device $tp) }}
{{- end }}
{{- else }}
{{- if gt $gpus 0.0 }}
{{- fail (printf "config.replica_resources.num_gpus (%v) must be 0 with config.engine.device %s (set device: cuda to run on GPUs)" $gpus (default "cpu" $engine.device)) }}
{{- end }}
{{- if le $cpus 0.0 }}
{{- fail "config.replica_resources.num_cpus must be > 0 on CPU: it sizes each worker pod to one engine replica" }}
{{- end }}
{{- end }}
{{- if include "pagefleet.autoscaling" . }}
{{- $w := include "pagefleet.workerCounts" . | fromJson }}
{{- if lt (int $w.max) (int $w.min) }}
{{- fail (printf "config.autoscaling.max_replicas (%d) must be >= config.autoscaling.min_replicas (%d)" (int $w.max) (int $w.min)) }}
{{- end }}
{{- if or (lt (int $w.replicas) (int $w.min)) (gt (int $w.replicas) (int $w.max)) }}
{{- fail (printf "config.autoscaling.initial_replicas (%d) must lie within [min_replicas, max_replicas] = [%d, %d]" (int $w.replicas) (int $w.min) (int $w.max)) }}
{{- end }}
{{- end }}
{{- range $i, $e := .Values.env }}
{{- if and (has $e.name (list "HF_TOKEN" "HUGGING_FACE_HUB_TOKEN" "PAGEFLEET_API_KEY")) (hasKey $e "value") }}
{{- fail (printf "env[%d] (%s): a secret must not be a literal value; use valueFrom.secretKeyRef (or modelSource.huggingFace.tokenSecret / apiKeySecret)" $i $e.name) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
True when config.autoscaling is set. An empty mapping counts (ServeConfig then autoscales with
its defaults), which a plain `if` would read as false.
*/}}
{{- define "pagefleet.autoscaling" -}}
{{- if and (hasKey .Values.config "autoscaling") (kindIs "map" .Values.config.autoscaling) }}true{{ end }}
{{- end }}

{{/*
Worker pod counts as JSON {replicas, min, max}: one engine replica per pod, so the group
follows config.replicas, or the autoscaling bounds (ServeConfig's defaults where unset).
*/}}
{{- define "pagefleet.workerCounts" -}}
{{- $c := .Values.config }}
{{- if include "pagefleet.autoscaling" . }}
{{- $a := $c.autoscaling }}
{{- $min := ternary 1 $a.min_replicas (kindIs "invalid" $a.min_replicas) | int }}
{{- $max := ternary 4 $a.max_replicas (kindIs "invalid" $a.max_replicas) | int }}
{{- $initial := ternary $min $a.initial_replicas (kindIs "invalid" $a.initial_replicas) | int }}
{{- dict "replicas" $initial "min" $min "max" $max | toJson }}
{{- else }}
{{- $n := ternary 1 $c.replicas (kindIs "invalid" $c.replicas) | int }}
{{- dict "replicas" $n "min" $n "max" $n | toJson }}
{{- end }}
{{- end }}

{{/* The Ray container's environment: the API key from its Secret, then the user's env. */}}
{{- define "pagefleet.env" -}}
{{- if .Values.apiKeySecret.name }}
- name: PAGEFLEET_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeySecret.name }}
      key: {{ .Values.apiKeySecret.key }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The init container that fills config.model before Ray starts: a Hub download, or the
make_model preset (seeded: every pod writes the same checkpoint; build_app, which would write
it under `serve deploy`, runs on one node only, and replicas run on others). Argument: a dict with
"root" (the top context), "resources" (the group's, less GPUs: a download needs none) and
"weights" (whether an engine replica can run on the pod: if not, its Hub download skips the
weights; the head's ingress needs only the tokenizer).
*/}}
{{- define "pagefleet.modelInit" -}}
{{- $ := .root }}
{{- $c := $.Values.config }}
{{- $hf := $.Values.modelSource.huggingFace }}
{{- if or $hf.repo $c.make_model }}
- name: fetch-model
  image: {{ include "pagefleet.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  env:
    - name: MODEL_DIR
      value: {{ $c.model | quote }}
    {{- if $hf.repo }}
    - name: HF_REPO
      value: {{ $hf.repo | quote }}
    - name: HF_REVISION
      value: {{ $hf.revision | quote }}
    - name: HF_WEIGHTS
      value: {{ ternary "1" "0" .weights | quote }}
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $hf.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $hf.tokenSecret.name }}
          key: {{ $hf.tokenSecret.key }}
    {{- end }}
    {{- else }}
    - name: MAKE_MODEL
      value: {{ $c.make_model | quote }}
    {{- end }}
  command: ["python", "-c"]
  args:
    {{- if $hf.repo }}
    # What pagefleet reads: config, tokenizer, chat template and, where an engine replica may
    # run, the safetensors weights (other weight formats are never loaded). Files already
    # there (a PVC keeps them across pods) are not fetched again.
    - |
      import os
      from huggingface_hub import snapshot_download
      patterns = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
      if os.environ["HF_WEIGHTS"] == "1":
          patterns.append("*.safetensors")
      snapshot_download(os.environ["HF_REPO"], revision=os.environ["HF_REVISION"] or None,
                        local_dir=os.environ["MODEL_DIR"], allow_patterns=patterns)
    {{- else }}
    # As build_app does: write the preset only where the directory is missing (or empty), so a
    # real checkpoint is never overwritten; written aside and renamed so that a pod killed
    # half-way leaves no partial checkpoint behind.
    - |
      import os, shutil, tempfile
      dst = os.environ["MODEL_DIR"].rstrip("/")
      if os.path.isdir(dst) and os.listdir(dst):
          print(f"{dst} is not empty: kept as it is")
      else:
          from pagefleet.cluster.make_model import make_model
          os.makedirs(os.path.dirname(dst), exist_ok=True)
          tmp = tempfile.mkdtemp(dir=os.path.dirname(dst), prefix=".make-model-")
          make_model(tmp, preset=os.environ["MAKE_MODEL"])
          try:
              if os.path.isdir(dst):
                  os.rmdir(dst)
              os.rename(tmp, dst)
          except OSError:  # another pod on a shared volume finished first: same checkpoint
              shutil.rmtree(tmp)
    {{- end }}
  {{- with .resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: models
      mountPath: {{ $.Values.modelSource.mountPath }}
{{- end }}
{{- end }}

{{/* Volumes of every Ray pod: the models volume (when used) and /dev/shm. */}}
{{- define "pagefleet.volumes" -}}
{{- if include "pagefleet.modelVolume" . }}
- name: models
  {{- if .Values.modelSource.pvc.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelSource.pvc.claimName }}
  {{- else if .Values.modelSource.emptyDirSizeLimit }}
  emptyDir:
    sizeLimit: {{ .Values.modelSource.emptyDirSizeLimit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sharedMemorySize }}
{{- end }}

{{- define "pagefleet.volumeMounts" -}}
{{- if include "pagefleet.modelVolume" . }}
- name: models
  mountPath: {{ .Values.modelSource.mountPath }}
  {{- if and .Values.modelSource.pvc.claimName .Values.modelSource.pvc.readOnly }}
  readOnly: true
  {{- end }}
{{- end }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
