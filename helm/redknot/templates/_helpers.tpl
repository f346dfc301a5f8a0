{{/* Names, labels, images and the settings every component shares. */}}

{{- define "redknot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "redknot.fullname" -}}
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

{{/* Name of one component's objects: <fullname>-<component>. Call with (list $ "store"). */}}
{{- define "redknot.component" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "redknot.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) }}
{{- end }}

{{- define "redknot.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: redknot-mla
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
{{ include "redknot.selectorLabels" . }}
{{- end }}

{{- define "redknot.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "redknot.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "redknot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "redknot.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The slim image, or the CUDA one when the second argument (GPUs asked for) is above zero. */}}
{{- define "redknot.image" -}}
{{- $root := index . 0 }}
{{- $tag := default $root.Chart.AppVersion $root.Values.image.tag }}
{{- if gt (int (index . 1)) 0 }}
{{- $tag = printf "%s%s" $tag $root.Values.image.cudaSuffix }}
{{- end }}
{{- printf "%s:%s" $root.Values.image.repository $tag }}
{{- end }}

{{/* Name of the Secret with the tenant tokens; fails with what to set when there is none. */}}
{{- define "redknot.tenantsSecret" -}}
{{- $generated := ternary (include "redknot.component" (list . "tenants")) "" (gt (len .Values.tenants.tokens) 0) }}
{{- required "tenant tokens are required: set tenants.existingSecret to a Secret whose key 'tokens' holds one 'tenant token' line per tenant (kubectl create secret generic redknot-tenants --from-file=tokens=./tokens), or list them in tenants.tokens as {tenant, token} items" (default $generated .Values.tenants.existingSecret) }}
{{- end }}

{{- define "redknot.modelPath" -}}
{{- required "model.path is required: the DeepSeek-V4 checkpoint directory inside the pods, e.g. /models/DeepSeek-V4-Flash, on the volume given in model.volume (e.g. {persistentVolumeClaim: {claimName: deepseek-v4}}) mounted at model.mountPath" .Values.model.path }}
{{- end }}

{{/* The bundled Redis's password (a generated Secret, or redis.auth.existingSecret) as REDIS_PASSWORD: the Redis
container requires it, the services' REDIS_URL carries it (Kubernetes expands $(REDIS_PASSWORD) there). */}}
{{- define "redknot.redisPasswordSecret" -}}
{{- default (include "redknot.component" (list . "redis")) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "redknot.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "redknot.redisPasswordSecret" . }}
      key: password
{{- end }}

{{/* REDIS_URL, from the bundled Redis, an external URL or a Secret. */}}
{{- define "redknot.redisUrlEnv" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled -}}
{{ include "redknot.redisPasswordEnv" . }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "redknot.component" (list . "redis")) | quote }}
{{- else if .Values.redis.enabled -}}
- name: REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "redknot.component" (list . "redis")) | quote }}
{{- else if .Values.redis.externalUrlSecret -}}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.externalUrlSecret }}
      key: {{ .Values.redis.externalUrlSecretKey }}
{{- else -}}
- name: REDIS_URL
  value: {{ required "Redis is required: keep redis.enabled=true (a bundled StatefulSet), or set redis.externalUrl (redis://host:6379/0) or redis.externalUrlSecret" .Values.redis.externalUrl | quote }}
{{- end }}
{{- end }}

{{/* What the API, the builder and the workers must agree on (services/common/settings.py CommonSettings). */}}
{{- define "redknot.commonEnv" -}}
{{ include "redknot.redisUrlEnv" . }}
- name: REDKNOT_REDIS_PREFIX
  value: {{ .Values.redis.prefix | quote }}
- name: REDKNOT_TOKENS_FILE
  value: /etc/redknot/tenants/{{ .Values.tenants.secretKey }}
- name: REDKNOT_MODEL
  value: {{ include "redknot.modelPath" . | quote }}
- name: REDKNOT_PROFILE
  value: {{ .Values.model.profile | quote }}
- name: REDKNOT_TP
  value: {{ .Values.worker.tp | quote }}
- name: REDKNOT_STORE_TARGET
  value: {{ printf "%s:%d" (include "redknot.component" (list . "store")) (int .Values.store.grpcPort) | quote }}
{{- with .Values.model.fingerprint }}
- name: REDKNOT_CHECKPOINT_FINGERPRINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.model.policy }}
- name: REDKNOT_POLICY
  value: {{ . | quote }}
{{- end }}
- name: HOME
  value: /tmp
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes every RedKnot pod gets: the tenant tokens and a writable /tmp. */}}
{{- define "redknot.commonVolumes" -}}
- name: tenants
  secret:
    secretName: {{ include "redknot.tenantsSecret" . }}
    defaultMode: 0440
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "redknot.commonMounts" -}}
- name: tenants
  mountPath: /etc/redknot/tenants
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "redknot.podSpecCommon" -}}
serviceAccountName: {{ include "redknot.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{- define "redknot.modelMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "redknot.modelVolume" -}}
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* resources with `count` GPUs of gpuResourceName added to the limits. Call with (list $ resources count). */}}
{{- define "redknot.resources" -}}
{{- $root := index . 0 -}}
{{- $res := deepCopy (index . 1) -}}
{{- $gpus := int (index . 2) -}}
{{- if gt $gpus 0 -}}
{{- $_ := set $res "limits" (merge (dict $root.Values.gpuResourceName $gpus) (default dict $res.limits)) -}}
{{- end -}}
{{- toYaml $res }}
{{- end }}

{{- /* REDKNOT_CPUS (the worker's and builder's `cpus` setting): the container's CPU share (its limit, else its
request; a whole count, rounded up), which a TP group's ranks divide among themselves for their torch threads
(services/common/tp.py rank_threads): the node's core count, which a process sees, is not the pod's share.
(list resources). */}}
{{- define "redknot.cpusEnv" -}}
{{- $res := index . 0 | default dict -}}
- name: REDKNOT_CPUS
  valueFrom:
    resourceFieldRef:
      resource: {{ ternary "limits.cpu" "requests.cpu" (hasKey ($res.limits | default dict) "cpu") }}
      divisor: "1"
{{- end }}

{{- /* A NetworkPolicy peer: the pods of one component of this release: (list $ "api"). */}}
{{- define "redknot.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
      app.kubernetes.io/component: {{ index . 1 }}
{{- end }}
