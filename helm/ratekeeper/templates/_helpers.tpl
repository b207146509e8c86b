{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "ratekeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name, prefixed to the chart name unless
it already contains it. Truncated to 63 characters (a DNS label); the headless and Redis Services
cut it shorter before adding their suffix.
*/}}
{{- define "ratekeeper.fullname" -}}
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

{{- define "ratekeeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "ratekeeper.labels" -}}
helm.sh/chart: {{ include "ratekeeper.chart" . }}
{{ include "ratekeeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of the ratekeeper pods (never change them: selectors are immutable). */}}
{{- define "ratekeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ratekeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Selector labels of the embedded Redis pod. */}}
{{- define "ratekeeper.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "ratekeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "ratekeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ratekeeper.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ratekeeper.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The ConfigMap holding the limits files: the chart's own or an existing one. */}}
{{- define "ratekeeper.configMapName" -}}
{{- default (printf "%s-limits" (include "ratekeeper.fullname" .)) .Values.existingConfigMap }}
{{- end }}

{{- define "ratekeeper.redisName" -}}
{{- printf "%s-redis" (include "ratekeeper.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{- define "ratekeeper.headlessName" -}}
{{- printf "%s-headless" (include "ratekeeper.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/*
The Redis address as configured (never with credentials): redis.url, else the
embedded Redis' Service, else empty (the in-memory store).
*/}}
{{- define "ratekeeper.redisBaseUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.embedded.enabled }}
{{- printf "redis://%s:6379" (include "ratekeeper.redisName" .) }}
{{- end }}
{{- end }}

{{/*
REDIS_URL as the binary reads it: the address, prefixed with the master's name
for sentinel (mastername,host:port,...). Credentials go in REDIS_AUTH, never here.
*/}}
{{- define "ratekeeper.redisUrl" -}}
{{- $base := include "ratekeeper.redisBaseUrl" . }}
{{- if and $base (eq .Values.redis.mode "sentinel") }}
{{- printf "%s,%s" .Values.redis.sentinel.masterName $base }}
{{- else }}
{{- $base }}
{{- end }}
{{- end }}

{{/* REDIS_TYPE: the chart's mode names mapped to the binary's. */}}
{{- define "ratekeeper.redisType" -}}
{{- get (dict "standalone" "single" "cluster" "cluster" "sentinel" "sentinel") .Values.redis.mode }}
{{- end }}

{{/* "true" when ratekeeper talks TLS to Redis (redis.tls.enabled or a rediss:// URL), else empty. */}}
{{- define "ratekeeper.redisTls" -}}
{{- if and (include "ratekeeper.redisBaseUrl" .) (or .Values.redis.tls.enabled (hasPrefix "rediss://" .Values.redis.url)) }}true{{ end }}
{{- end }}

{{/* Where the Secret volumes are mounted. */}}
{{- define "ratekeeper.redisTlsDir" -}}/etc/ratekeeper/redis-tls{{- end }}
{{- define "ratekeeper.grpcTlsDir" -}}/etc/ratekeeper/grpc-tls{{- end }}

{{/*
EXPECTED_REPLICAS: expectedReplicas, else autoscaling.maxReplicas with the HPA
(all pods together never exceed a limit in failure mode local), else replicaCount.
*/}}
{{- define "ratekeeper.expectedReplicas" -}}
{{- if not (kindIs "invalid" .Values.expectedReplicas) }}
{{- .Values.expectedReplicas | int64 }}
{{- else if .Values.autoscaling.enabled }}
{{- .Values.autoscaling.maxReplicas | int64 }}
{{- else }}
{{- max 1 (int .Values.replicaCount) }}
{{- end }}
{{- end }}

{{/* Refuses combinations the schema cannot express. */}}
{{- define "ratekeeper.validate" -}}
{{- $shared := include "ratekeeper.redisBaseUrl" . }}
{{- $redis := .Values.redis }}
{{- if and $redis.url $redis.embedded.enabled }}
{{- fail "redis.url and redis.embedded.enabled are exclusive: the embedded Redis is only for when no Redis URL is given" }}
{{- end }}
{{- if and (not $shared) (or .Values.autoscaling.enabled (gt (int .Values.replicaCount) 1)) }}
{{- fail "more than one replica (replicaCount > 1 or autoscaling.enabled) needs a shared Redis: set redis.url or redis.embedded.enabled, otherwise every replica counts on its own" }}
{{- end }}
{{- if and $redis.auth.existingSecret (not $shared) }}
{{- fail "redis.auth.existingSecret needs a Redis: set redis.url or redis.embedded.enabled" }}
{{- end }}
{{- /* The schema refuses it too; this holds with --skip-schema-validation. */}}
{{- if contains "@" $redis.url }}
{{- fail "redis.url must not carry credentials: put the password in a Secret and name it in redis.auth.existingSecret" }}
{{- end }}
{{- if or $redis.tls.enabled $redis.tls.existingSecret }}
{{- if $redis.embedded.enabled }}
{{- fail "redis.tls: the embedded Redis serves no TLS; use redis.url for a Redis with TLS" }}
{{- else if not $shared }}
{{- fail "redis.tls needs a Redis: set redis.url" }}
{{- end }}
{{- end }}
{{- if $redis.tls.existingSecret }}
{{- if not (include "ratekeeper.redisTls" .) }}
{{- fail "redis.tls.existingSecret needs redis.tls.enabled (or a rediss:// redis.url)" }}
{{- end }}
{{- if not (or $redis.tls.caCert $redis.tls.clientCert) }}
{{- fail "redis.tls.existingSecret is unused: set redis.tls.caCert and/or redis.tls.clientCert" }}
{{- end }}
{{- end }}
{{- if and .Values.grpcTls.clientCA (not .Values.grpcTls.existingSecret) }}
{{- fail "grpcTls.clientCA needs grpcTls.existingSecret (its ca.crt)" }}
{{- end }}
{{- if .Values.podDisruptionBudget.enabled }}
{{- $min := not (kindIs "invalid" .Values.podDisruptionBudget.minAvailable) }}
{{- $max := not (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable) }}
{{- if eq $min $max }}
{{- fail "podDisruptionBudget: set exactly one of minAvailable and maxUnavailable (null the other)" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on the embedded Redis' objects (component: redis, never selected as the server). */}}
{{- define "ratekeeper.redisLabels" -}}
helm.sh/chart: {{ include "ratekeeper.chart" . }}
{{ include "ratekeeper.redisSelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}
