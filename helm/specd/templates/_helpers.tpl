{{/* Names, labels and small shared pieces of the specd chart. */}}

{{- define "specd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specd.fullname" -}}
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

{{- define "specd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "specd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specd.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "specd.routerName" -}}{{ include "specd.fullname" . }}-router{{- end }}
{{- define "specd.configName" -}}{{ include "specd.fullname" . }}-config{{- end }}
{{- define "specd.redisName" -}}{{ include "specd.fullname" . }}-redis{{- end }}

{{- define "specd.tokenSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-token" (include "specd.fullname" .)) }}
{{- end }}

{{- define "specd.adminTokenSecret" -}}
{{- .Values.auth.admin.existingSecret | default (printf "%s-admin-token" (include "specd.fullname" .)) }}
{{- end }}

{{- define "specd.adminEnabled" -}}
{{- if and .Values.auth.enabled .Values.auth.admin.enabled }}true{{ end }}
{{- end }}

{{- define "specd.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "specd.fullname" .)) }}
{{- end }}

{{- define "specd.redisSecret" -}}
{{- .Values.redis.password.existingSecret | default (printf "%s-redis" (include "specd.fullname" .)) }}
{{- end }}

{{/* The Redis URL the router and trainer use: the release's StatefulSet or the external one. */}}
{{- define "specd.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc:6379/0" (include "specd.redisName" .) .Release.Namespace }}
{{- else }}
{{- .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* host:port of the Redis the GCS keeps its state in (gcsFaultTolerance). */}}
{{- define "specd.redisAddress" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s.%s.svc:6379" (include "specd.redisName" .) .Release.Namespace }}
{{- else }}
{{- regexReplaceAll "^rediss?://([^/]*@)?([^/]+).*$" .Values.redis.externalUrl "${2}" }}
{{- end }}
{{- end }}

{{/* Kubernetes resources of a pod group from {cpu, memory, gpus}. */}}
{{- define "specd.resources" -}}
requests:
  cpu: {{ .cpu | quote }}
  memory: {{ .memory | quote }}
  {{- if .gpus }}
  nvidia.com/gpu: {{ .gpus }}
  {{- end }}
limits:
  cpu: {{ .cpu | quote }}
  memory: {{ .memory | quote }}
  {{- if .gpus }}
  nvidia.com/gpu: {{ .gpus }}
  {{- end }}
{{- end }}

{{- define "specd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (include "specd.fullname" .) }}
{{- else }}
{{- .Values.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}

{{/* Ray GPUs of the target actor: with shared GPUs the drafter's fraction comes out of the target's. */}}
{{- define "specd.targetActorGpus" -}}
{{- if and .Values.draft.shareTargetGPUs (gt (int .Values.target.gpus) 0) }}
{{- subf (float64 .Values.target.gpus) (float64 .Values.draft.gpuFraction) }}
{{- else }}
{{- .Values.target.gpus }}
{{- end }}
{{- end }}

{{- define "specd.drafterActorGpus" -}}
{{- if .Values.draft.shareTargetGPUs }}
{{- ternary .Values.draft.gpuFraction 0 (gt (int .Values.target.gpus) 0) }}
{{- else }}
{{- .Values.draft.gpus }}
{{- end }}
{{- end }}

{{/* What every pod of the release has: service account, pull secrets, the restricted pod context. */}}
{{- define "specd.podCommon" -}}
serviceAccountName: {{ include "specd.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* The restricted securityContext of every container (Pod Security "restricted"). */}}
{{- define "specd.containerSecurity" -}}
securityContext:
  runAsNonRoot: true
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  seccompProfile:
    type: RuntimeDefault
{{- end }}

{{/* Writable places of a specd container on a read-only root: /tmp (Ray's sockets and logs; shared by
the head's two containers), $HOME and the cache (drafters downloaded from Redis, the first-start one). */}}
{{- define "specd.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/specd
- name: cache
  mountPath: /var/cache/specd
{{- end }}

{{- define "specd.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- end }}

{{- define "specd.commonEnv" -}}
- name: HOME
  value: /home/specd
- name: SPECD_CACHE
  value: /var/cache/specd
- name: SPECD_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specd.redisSecret" . }}
      key: {{ .Values.redis.password.key }}
      optional: true
{{- end }}

{{/* A Ray worker container: KubeRay writes its `ray start` from the group's rayStartParams. */}}
{{- define "specd.rayContainer" -}}
- name: ray-worker
  image: {{ include "specd.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  resources:
    {{- include "specd.resources" .group | nindent 4 }}
  {{- include "specd.containerSecurity" . | nindent 2 }}
  env:
    {{- include "specd.commonEnv" .root | nindent 4 }}
  volumeMounts:
    {{- include "specd.writableMounts" . | nindent 4 }}
    {{- if .trainer }}
    - name: trainer-store
      mountPath: /var/lib/specd/trainer
    {{- end }}
{{- end }}

{{/* Pod placement of a group. */}}
{{- define "specd.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A router pod's `ray start`, as KubeRay writes a worker's (tests/helm/kuberay.py): joins the head
Service, offers no CPUs (no actor lands on a router's node) and the specd_router resource. */}}
{{- define "specd.routerRayStart" -}}
{{- $address := printf "%s-head-svc.%s.svc.cluster.local:%v" (include "specd.fullname" .root) .root.Release.Namespace .headPort }}
{{- $params := dict "address" $address "num-cpus" "0" "block" "true" "metrics-export-port" "8080" "dashboard-agent-listen-port" "52365" }}
{{- range $k, $v := .root.Values.router.rayStartParams }}{{ $_ := set $params $k (toString $v) }}{{ end -}}
ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; exec ray start --resources='{"specd_router":1}'
{{- range $k := keys $params | sortAlpha }}{{ $v := index $params $k }}{{ if eq $v "true" }} --{{ $k }}{{ else }} --{{ $k }}={{ $v }}{{ end }}{{ end }}
{{- end }}

{{/* The dashboard agent's port on a router pod: where its Ray node answers /api/healthz. */}}
{{- define "specd.routerAgentPort" -}}
{{- index .Values.router.rayStartParams "dashboard-agent-listen-port" | default 52365 }}
{{- end }}
