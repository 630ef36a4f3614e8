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
the pods are told apart by instance, part-of and component instead. Every selector of the Ray
pods (metrics Service, PodMonitor, PodDisruptionBudgets, NetworkPolicy) uses these, so it
matches the pods of both clusters during a zero-downtime upgrade and no other pod (the model
download Job's pod has no part-of label).
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

{{/*
The claim holding the models: modelSource.pvc.claimName (an existing claim, or the name of the
one the chart creates), `<fullname>-models` when the chart creates one without a name, else
empty (no PVC).
*/}}
{{- define "pagefleet.modelClaim" -}}
{{- $pvc := .Values.modelSource.pvc }}
{{- if $pvc.claimName }}{{ $pvc.claimName }}
{{- else if $pvc.create }}{{ include "pagefleet.fullname" . }}-models
{{- end }}
{{- end }}

{{/* True when something fills config.model on a volume (so the volume is mounted). */}}
{{- define "pagefleet.modelVolume" -}}
{{- if or .Values.modelSource.huggingFace.repo (include "pagefleet.modelClaim" .) .Values.config.make_model }}true{{ end }}
{{- end }}

{{/*
The longest a stopping replica drains, as pagefleet computes it (ServeConfig.drain_s):
max(drain_timeout_s, request_timeout_s), ServeConfig's defaults (60, 600) where unset, rounded up
to whole seconds. A null in Helm values deletes the key, so an unset field is its default.
*/}}
{{- define "pagefleet.drainSeconds" -}}
{{- $c := .Values.config }}
{{- $drain := ternary 60.0 $c.drain_timeout_s (kindIs "invalid" $c.drain_timeout_s) | float64 }}
{{- $timeout := ternary 600.0 $c.request_timeout_s (kindIs "invalid" $c.request_timeout_s) | float64 }}
{{- int (ceil (maxf $drain $timeout)) }}
{{- end }}

{{- define "pagefleet.requestTimeoutSeconds" -}}
{{- $c := .Values.config }}
{{- int (ceil (ternary 600.0 $c.request_timeout_s (kindIs "invalid" $c.request_timeout_s) | float64)) }}
{{- end }}

{{/*
Seconds added to the drain time by the derived defaults below: the Service's endpoints reach
kube-proxy and ingress controllers a few seconds after KubeRay moves them, and a pod needs a
moment to exit after its last request.
*/}}
{{- define "pagefleet.drainMarginSeconds" -}}30{{- end }}

{{/* terminationGracePeriodSeconds of every Ray pod: the value, or the drain time plus the margin. */}}
{{- define "pagefleet.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add (include "pagefleet.drainSeconds" . | int) (include "pagefleet.drainMarginSeconds" . | int) }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* rayClusterDeletionDelaySeconds: the value, or the drain time plus the margin. */}}
{{- define "pagefleet.rayClusterDeletionDelaySeconds" -}}
{{- if kindIs "invalid" .Values.rayClusterDeletionDelaySeconds }}
{{- add (include "pagefleet.drainSeconds" . | int) (include "pagefleet.drainMarginSeconds" . | int) }}
{{- else }}
{{- int .Values.rayClusterDeletionDelaySeconds }}
{{- end }}
{{- end }}

{{/*
Millicores of a Kubernetes CPU quantity ("500m", "2", "1.5", or a number); empty when unset.
*/}}
{{- define "pagefleet.cpuMillis" -}}
{{- if not (kindIs "invalid" .) }}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}{{ trimSuffix "m" $q | float64 }}{{ else }}{{ mulf (float64 $q) 1000 }}{{ end }}
{{- end }}
{{- end }}

{{/*
Fails when Ray's num-cpus for a group exceeds the CPUs its pod requests (the request, or the
limit, which Kubernetes takes as the request when only it is set): Ray would then schedule more
work on the pod than the node reserved for it. Argument: dict "group" (head / worker), "values"
(the group's values), "numCpus" (the num-cpus rayStartParam as rendered).
*/}}
{{- define "pagefleet.checkCpus" -}}
{{- $res := .values.resources | default dict }}
{{- $requests := $res.requests | default dict }}
{{- $limits := $res.limits | default dict }}
{{- $cpu := ternary $limits.cpu $requests.cpu (kindIs "invalid" $requests.cpu) }}
{{- $ray := float64 .numCpus }}
{{- if gt $ray 0.0 }}
{{- if kindIs "invalid" $cpu }}
{{- fail (printf "%s.resources.requests.cpu is unset, but Ray's num-cpus on the %s is %s: request at least that many CPUs" .group .group .numCpus) }}
{{- end }}
{{- $millis := include "pagefleet.cpuMillis" $cpu | float64 }}
{{- if gt (mulf $ray 1000) $millis }}
{{- fail (printf "Ray's num-cpus on the %s (%s) is larger than %s.resources.requests.cpu (%v): Ray would run more than the pod reserves; raise the request or lower %s" .group .numCpus .group $cpu (ternary "config.replica_resources.num_cpus" "head.rayStartParams.num-cpus" (eq .group "worker"))) }}
{{- end }}
{{- end }}
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
{{- $strategy := default "STRICT_PACK" $res.placement_group_strategy }}
{{- if and $src.huggingFace.repo $c.make_model }}
{{- fail "modelSource.huggingFace.repo and config.make_model both fill config.model: set one of them" }}
{{- end }}
{{- if and $src.huggingFace.repo (not (include "pagefleet.modelClaim" .)) }}
{{- fail "modelSource.huggingFace.repo is downloaded once into a PVC: set modelSource.pvc.create=true (the chart makes the claim) or modelSource.pvc.claimName (an existing ReadWriteMany claim)" }}
{{- end }}
{{- if include "pagefleet.modelVolume" . }}
{{- $mount := trimSuffix "/" $src.mountPath }}
{{- if not (hasPrefix (printf "%s/" $mount) $c.model) }}
{{- fail (printf "config.model (%s) must lie under modelSource.mountPath (%s), where the models volume is mounted" $c.model $src.mountPath) }}
{{- end }}
{{- end }}
{{- if and (gt $tp 1) (not (has $strategy (list "PACK" "STRICT_PACK"))) }}
{{- fail (printf "config.replica_resources.placement_group_strategy (%s) must be PACK or STRICT_PACK with config.engine.tensor_parallel_size %d: a worker pod holds every rank of one replica, so its bundles must be packed onto one node" $strategy $tp) }}
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
{{- $w := include "pagefleet.workerCounts" . | fromJson }}
{{- if include "pagefleet.autoscaling" . }}
{{- if lt (int $w.serveMax) (int $w.serveMin) }}
{{- fail (printf "config.autoscaling.max_replicas (%d) must be >= config.autoscaling.min_replicas (%d)" (int $w.serveMax) (int $w.serveMin)) }}
{{- end }}
{{- if or (lt (int $w.replicas) (int $w.serveMin)) (gt (int $w.replicas) (int $w.serveMax)) }}
{{- fail (printf "config.autoscaling.initial_replicas (%d) must lie within [min_replicas, max_replicas] = [%d, %d]" (int $w.replicas) (int $w.serveMin) (int $w.serveMax)) }}
{{- end }}
{{- end }}
{{- if lt (int $w.max) (int $w.serveMax) }}
{{- fail (printf "worker.maxReplicas (%d) is below the %d engine replicas Serve may run (%s): one worker pod holds one replica; raise worker.maxReplicas or leave it unset" (int $w.max) (int $w.serveMax) (ternary "config.autoscaling.max_replicas" "config.replicas" (eq (include "pagefleet.autoscaling" .) "true"))) }}
{{- end }}
{{- if not (kindIs "invalid" .Values.rayClusterDeletionDelaySeconds) }}
{{- $timeout := int (include "pagefleet.requestTimeoutSeconds" .) }}
{{- if lt (int .Values.rayClusterDeletionDelaySeconds) $timeout }}
{{- fail (printf "rayClusterDeletionDelaySeconds (%d) must be at least config.request_timeout_s (%d): the old cluster must outlive the requests it accepted before the switch" (int .Values.rayClusterDeletionDelaySeconds) $timeout) }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}
{{- $drain := int (include "pagefleet.drainSeconds" .) }}
{{- if lt (int .Values.terminationGracePeriodSeconds) $drain }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be at least the drain time, max(config.drain_timeout_s, config.request_timeout_s) = %d: a stopping replica waits that long for its requests" (int .Values.terminationGracePeriodSeconds) $drain) }}
{{- end }}
{{- end }}
{{- $upgrade := .Values.upgradeStrategy }}
{{- if and (eq $upgrade.type "NewClusterWithIncrementalUpgrade") (not $upgrade.clusterUpgradeOptions.gatewayClassName) }}
{{- fail "upgradeStrategy.clusterUpgradeOptions.gatewayClassName is required with upgradeStrategy.type NewClusterWithIncrementalUpgrade: KubeRay moves traffic through a Gateway of that class" }}
{{- end }}
{{- if and .Values.gcsFaultTolerance.enabled (not .Values.gcsFaultTolerance.redisAddress) }}
{{- fail "gcsFaultTolerance.redisAddress is required with gcsFaultTolerance.enabled (host:port of the external Redis)" }}
{{- end }}
{{- if and (or .Values.ingress.enabled .Values.httpRoute.enabled) (not .Values.apiKeySecret.name) (not .Values.allowUnauthenticated) }}
{{- fail (printf "%s exposes the OpenAI endpoint with no API key: set apiKeySecret.name (a Secret holding the key clients must send), or allowUnauthenticated: true to expose it open to anyone who reaches it" (ternary "ingress.enabled" "httpRoute.enabled" .Values.ingress.enabled)) }}
{{- end }}
{{- if and .Values.httpRoute.enabled (not .Values.httpRoute.parentRefs) }}
{{- fail "httpRoute.parentRefs must name at least one Gateway with httpRoute.enabled" }}
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
Worker pod counts as JSON. Serve's bounds (serveMin / serveMax: config.replicas, or the
autoscaling bounds with ServeConfig's defaults where unset) live in serveConfigV2 only; the
worker group is the Ray autoscaler's, decoupled from them: min 0, max the capacity ceiling
(worker.maxReplicas, default serveMax), replicas the pods a new cluster starts with (Serve's
initial count). KubeRay hashes the group without these three, so none of them ever makes a new
cluster.
*/}}
{{- define "pagefleet.workerCounts" -}}
{{- $c := .Values.config }}
{{- $min := 0 }}
{{- $max := 0 }}
{{- $initial := 0 }}
{{- if include "pagefleet.autoscaling" . }}
{{- $a := $c.autoscaling }}
{{- $min = ternary 1 $a.min_replicas (kindIs "invalid" $a.min_replicas) | int }}
{{- $max = ternary 4 $a.max_replicas (kindIs "invalid" $a.max_replicas) | int }}
{{- $initial = ternary $min $a.initial_replicas (kindIs "invalid" $a.initial_replicas) | int }}
{{- else }}
{{- $min = ternary 1 $c.replicas (kindIs "invalid" $c.replicas) | int }}
{{- $max = $min }}
{{- $initial = $min }}
{{- end }}
{{- $ceiling := ternary $max .Values.worker.maxReplicas (kindIs "invalid" .Values.worker.maxReplicas) | int }}
{{- dict "replicas" $initial "min" 0 "max" $ceiling "serveMin" $min "serveMax" $max | toJson }}
{{- end }}

{{/*
The EngineReplica deployment's scaling options as JSON (pagefleet/cluster/config.py
engine_scaling_options): num_replicas, or "auto" with an autoscaling_config running
pagefleet's policy, with ServeConfig's defaults (pagefleet/cluster/autoscaling.py) where unset; the
policy gets config.autoscaling as written (it fills in its own defaults).
*/}}
{{- define "pagefleet.engineScaling" -}}
{{- $c := .Values.config }}
{{- $w := include "pagefleet.workerCounts" . | fromJson }}
{{- if include "pagefleet.autoscaling" . }}
{{- $a := $c.autoscaling }}
{{- $s := dict "min_replicas" (int $w.serveMin) "max_replicas" (int $w.serveMax) "initial_replicas" (int $w.replicas) }}
{{- $_ := set $s "upscale_delay_s" (ternary 0.0 $a.upscale_delay_s (kindIs "invalid" $a.upscale_delay_s)) }}
{{- $_ := set $s "downscale_delay_s" (ternary 0.0 $a.downscale_delay_s (kindIs "invalid" $a.downscale_delay_s)) }}
{{- $_ := set $s "look_back_period_s" (ternary 15.0 $a.look_back_period_s (kindIs "invalid" $a.look_back_period_s)) }}
{{- $_ := set $s "metrics_interval_s" (ternary 2.0 $a.metrics_interval_s (kindIs "invalid" $a.metrics_interval_s)) }}
{{- $_ := set $s "policy" (dict "policy_function" "pagefleet.cluster.autoscaling:KVCacheAutoscalingPolicy" "policy_kwargs" $a) }}
{{- dict "num_replicas" "auto" "autoscaling_config" $s | toJson }}
{{- else }}
{{- dict "num_replicas" (int $w.serveMin) | toJson }}
{{- end }}
{{- end }}

{{/*
The Ingress deployment's max_ongoing_requests, as build_app computes it: every engine
replica's max_ongoing_requests (default engine.max_num_seqs + max_waiting_requests) times the
fleet's largest size, plus the queue in front of the engines (max_queued_requests, default
max_waiting_requests), plus the headroom (app.py INGRESS_HEADROOM). ServeConfig's defaults
where unset (64, 192).
*/}}
{{- define "pagefleet.ingressMaxOngoingRequests" -}}
{{- $c := .Values.config }}
{{- $w := include "pagefleet.workerCounts" . | fromJson }}
{{- $e := $c.engine | default dict }}
{{- $waiting := ternary 192 $c.max_waiting_requests (kindIs "invalid" $c.max_waiting_requests) | int }}
{{- $seqs := ternary 64 $e.max_num_seqs (kindIs "invalid" $e.max_num_seqs) | int }}
{{- $perReplica := ternary (add $seqs $waiting) $c.max_ongoing_requests (kindIs "invalid" $c.max_ongoing_requests) | int }}
{{- $queued := ternary (max 1 $waiting) $c.max_queued_requests (kindIs "invalid" $c.max_queued_requests) | int }}
{{- $replicas := ternary 1 $c.replicas (kindIs "invalid" $c.replicas) | int }}
{{- $fleet := ternary (max $replicas $w.serveMax) $replicas (eq (include "pagefleet.autoscaling" .) "true") | int }}
{{- add (mul $perReplica $fleet) $queued 64 }}
{{- end }}

{{/*
The Ray container's environment: the header bound of Serve's proxies (config.limits'
max_header_bytes / max_headers through pagefleet's proxy callback; unset: ServeConfig's
defaults), caches under /tmp (the root filesystem is read-only), the API key from its Secret,
HF_HUB_OFFLINE=1 (the model is local; nothing in a Ray pod reaches the Hub), then the user's env.
*/}}
{{- define "pagefleet.env" -}}
{{- $limits := .Values.config.limits | default dict }}
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: pagefleet.cluster.http.header_limits:proxy_middlewares
{{- with $limits.max_header_bytes }}
- name: PAGEFLEET_MAX_HEADER_BYTES
  value: {{ . | int | quote }}
{{- end }}
{{- with $limits.max_headers }}
- name: PAGEFLEET_MAX_HEADERS
  value: {{ . | int | quote }}
{{- end }}
- name: XDG_CACHE_HOME
  value: /tmp/cache
{{- if .Values.apiKeySecret.name }}
- name: PAGEFLEET_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeySecret.name }}
      key: {{ .Values.apiKeySecret.key }}
{{- end }}
{{- $names := list }}
{{- range .Values.env }}{{ $names = append $names .name }}{{ end }}
{{- if not (has "HF_HUB_OFFLINE" $names) }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The init container that writes the config.make_model preset into config.model before Ray
starts (seeded: every pod writes the same checkpoint; build_app, which would write it under
`serve deploy`, runs on one node only, and replicas run on others). No download: a Hub model
comes from the model-download hook Job, once, into the PVC. Argument: a dict with "root" (the
top context) and "resources" (the group's, less GPUs).
*/}}
{{- define "pagefleet.modelInit" -}}
{{- $ := .root }}
{{- $c := $.Values.config }}
{{- if $c.make_model }}
- name: make-model
  image: {{ include "pagefleet.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  {{- with $.Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: MODEL_DIR
      value: {{ $c.model | quote }}
    - name: MAKE_MODEL
      value: {{ $c.make_model | quote }}
  command: ["python", "-c"]
  args:
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
  {{- with .resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: models
      mountPath: {{ $.Values.modelSource.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Volumes of every Ray pod: the models volume (when used), /dev/shm and /tmp. */}}
{{- define "pagefleet.volumes" -}}
{{- if include "pagefleet.modelVolume" . }}
- name: models
  {{- $claim := include "pagefleet.modelClaim" . }}
  {{- if $claim }}
  persistentVolumeClaim:
    claimName: {{ $claim }}
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
- name: tmp
  {{- if .Values.tmpSizeLimit }}
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}

{{/* The service account token the autoscaler sidecar alone mounts (what the kubelet would
mount in every container with automountServiceAccountToken). */}}
{{- define "pagefleet.autoscalerTokenVolume" -}}
- name: autoscaler-api-token
  projected:
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}

{{/* The Ray container's mounts: the models (read-only on a PVC by default) and /dev/shm. */}}
{{- define "pagefleet.volumeMounts" -}}
{{- if include "pagefleet.modelVolume" . }}
- name: models
  mountPath: {{ .Values.modelSource.mountPath }}
  {{- if and (include "pagefleet.modelClaim" .) .Values.modelSource.pvc.readOnly }}
  readOnly: true
  {{- end }}
{{- end }}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Ray's metrics port in a group (rayStartParams' metrics-export-port, KubeRay's 8080). */}}
{{- define "pagefleet.rayMetricsPort" -}}
{{- int (get . "metrics-export-port" | default "8080") }}
{{- end }}

{{/*
The pod spec of a Ray group. Argument: a dict with "root" (the top context), "group" ("head"
or "worker"), "container" (the Ray container's name), "ports" (its ports, a list of dicts),
"resources" (its resources), "initResources" (the make-model init container's).
*/}}
{{- define "pagefleet.rayPodSpec" -}}
{{- $ := .root }}
{{- $g := get $.Values .group }}
{{- with $.Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ $.Values.automountServiceAccountToken }}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $g.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
# At least the drain time: a stopping replica waits for its requests that long.
terminationGracePeriodSeconds: {{ include "pagefleet.terminationGracePeriodSeconds" $ }}
{{- with $.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (include "pagefleet.modelInit" (dict "root" $ "resources" .initResources)) }}
initContainers:
  {{- . | trim | nindent 2 }}
{{- end }}
containers:
  - name: {{ .container }}
    image: {{ include "pagefleet.image" $ }}
    imagePullPolicy: {{ $.Values.image.pullPolicy }}
    {{- with $.Values.containerSecurityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    ports:
      {{- toYaml .ports | nindent 6 }}
    env:
      {{- include "pagefleet.env" $ | trim | nindent 6 }}
    {{- with $.Values.envFrom }}
    envFrom:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- include "pagefleet.volumeMounts" $ | trim | nindent 6 }}
volumes:
  {{- include "pagefleet.volumes" $ | trim | nindent 2 }}
  {{- if .autoscalerToken }}
  {{- include "pagefleet.autoscalerTokenVolume" $ | trim | nindent 2 }}
  {{- end }}
{{- with $g.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
