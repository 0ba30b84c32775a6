{{/* Names, labels and shared snippets. */}}

{{- define "outrider.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "outrider.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "outrider.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "outrider.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "outrider.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outrider.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "outrider.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}
{{- end -}}

{{/* Security contexts: every Outrider pod's, and every container's (`readOnly`: a read-only
root filesystem too). */}}
{{- define "outrider.podSecurityContext" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
{{- define "outrider.securityContext" -}}
{{- $context := deepCopy .root.Values.securityContext -}}
{{- if .readOnly -}}
{{- $_ := set $context "readOnlyRootFilesystem" true -}}
{{- end -}}
{{- with $context }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The RayCluster and the Service KubeRay makes for its head (<cluster>-head-svc). */}}
{{- define "outrider.rayClusterName" -}}
{{- printf "%s-ray" (include "outrider.fullname" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- define "outrider.headService" -}}
{{- printf "%s-head-svc" (include "outrider.rayClusterName" .) -}}
{{- end -}}

{{- define "outrider.rayAuthSecret" -}}
{{- default (printf "%s-ray-auth" (include "outrider.fullname" .)) .Values.ray.auth.secretName -}}
{{- end -}}

{{- define "outrider.redisName" -}}
{{- printf "%s-redis" (include "outrider.fullname" .) -}}
{{- end -}}
{{- define "outrider.redisSecret" -}}
{{- default (include "outrider.redisName" .) .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- define "outrider.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (include "outrider.redisName" .) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "outrider.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "outrider.fullname" .)) .Values.router.apiKeys.existingSecret -}}
{{- end -}}

{{/* Ray's --resources wants a JSON object that survives a shell: '"{\"name\": 1}"'. */}}
{{- define "outrider.rayResources" -}}
{{- . | toJson | quote | squote -}}
{{- end -}}

{{/* Environment every Outrider process gets. */}}
{{- define "outrider.env" -}}
- name: OUTRIDER_CONFIG
  value: /etc/outrider/outrider.yaml
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "outrider.redisSecret" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- if .Values.telemetry.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.telemetry.otlpEndpoint | quote }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ .Values.telemetry.serviceName | quote }}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "outrider.rayAuthSecret" . }}
      key: auth_token
{{- end }}
{{- end -}}

{{/* A Ray pod's probes: the raylet's health, and on the head the GCS's too. */}}
{{- define "outrider.rayProbes" -}}
{{- $check := "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success" -}}
{{- if .head -}}
{{- $check = printf "%s && wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success" $check -}}
{{- end -}}
readinessProbe:
  exec:
    command: ["bash", "-c", {{ $check | quote }}]
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 10
livenessProbe:
  exec:
    command: ["bash", "-c", {{ $check | quote }}]
  initialDelaySeconds: 30
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 120
{{- end -}}

{{/* Volumes shared by Ray pods: /dev/shm in memory, and the deployment config. */}}
{{- define "outrider.rayVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sharedMemorySize }}
- name: config
  configMap:
    name: {{ include "outrider.fullname" . }}-config
{{- end -}}
{{- define "outrider.rayVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: config
  mountPath: /etc/outrider
  readOnly: true
{{- end -}}
