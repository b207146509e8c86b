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
The Redis URL without credentials: redis.url, else the embedded Redis' Service,
else empty (the in-memory store).
*/}}
{{- define "ratekeeper.redisBaseUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.embedded.enabled }}
{{- printf "redis://%s:6379" (include "ratekeeper.redisName" .) }}
{{- end }}
{{- end }}

{{/*
REDIS_URL as the container sees it. With auth.existingSecret the password goes
in as $(REDIS_PASSWORD), which Kubernetes expands from the REDIS_PASSWORD env
var defined before it: redis://[username]:$(REDIS_PASSWORD)@host:port[/db].
*/}}
{{- define "ratekeeper.redisUrl" -}}
{{- $base := include "ratekeeper.redisBaseUrl" . }}
{{- if and $base .Values.redis.auth.existingSecret }}
{{- $u := urlParse $base }}
{{- printf "%s://%s:$(REDIS_PASSWORD)@%s%s" $u.scheme .Values.redis.auth.username $u.host $u.path }}
{{- else }}
{{- $base }}
{{- end }}
{{- end }}

{{/* Refuses combinations the schema cannot express. */}}
{{- define "ratekeeper.validate" -}}
{{- $shared := include "ratekeeper.redisBaseUrl" . }}
{{- if and .Values.redis.url .Values.redis.embedded.enabled }}
{{- fail "redis.url and redis.embedded.enabled are exclusive: the embedded Redis is only for when no Redis URL is given" }}
{{- end }}
{{- if and (not $shared) (or .Values.autoscaling.enabled (gt (int .Values.replicaCount) 1)) }}
{{- fail "more than one replica (replicaCount > 1 or autoscaling.enabled) needs a shared Redis: set redis.url or redis.embedded.enabled, otherwise every replica counts on its own" }}
{{- end }}
{{- if and .Values.redis.auth.existingSecret (not $shared) }}
{{- fail "redis.auth.existingSecret needs a Redis: set redis.url or redis.embedded.enabled" }}
{{- end }}
{{- if and .Values.redis.url (regexMatch "^redis://[^/]*@" .Values.redis.url) }}
{{- fail "redis.url must not carry credentials: put the password in a Secret and name it in redis.auth.existingSecret" }}
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
