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

{{/* A Ray worker container: joins the head; Ray reads rayStartParams from the group spec. */}}
{{- define "specd.rayContainer" -}}
- name: ray-worker
  image: {{ include "specd.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  resources:
    {{- include "specd.resources" .group | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    allowPrivilegeEscalation: false
  env:
    - name: SPECD_REDIS_PASSWORD
      valueFrom:
        secretKeyRef:
          name: {{ include "specd.redisSecret" .root }}
          key: {{ .root.Values.redis.password.key }}
          optional: true
  volumeMounts:
    - name: ray-logs
      mountPath: /tmp/ray
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
{{- end }}
