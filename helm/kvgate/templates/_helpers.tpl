{{/* Names and labels. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
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

{{- define "kvgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ include "kvgate.chart" . }}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvgate.gatewayLabels" -}}
{{ include "kvgate.labels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "kvgate.gatewaySelector" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/* What only the metrics Service carries: the ServiceMonitor selects it by this. */}}
{{- define "kvgate.metricsLabel" -}}
kvgate.io/port: metrics
{{- end -}}

{{- define "kvgate.redisSelector" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.secretName" -}}
{{- default (include "kvgate.fullname" .) .Values.secret.existingSecret -}}
{{- end -}}

{{- define "kvgate.redisName" -}}
{{- printf "%s-redis" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Kubernetes discovery is on: the gateway lists and watches EndpointSlices. */}}
{{- define "kvgate.discovers" -}}
{{- if or .Values.epp.enabled (eq (default "static" .Values.config.discovery) "kubernetes") -}}true{{- end -}}
{{- end -}}

{{/* The InferencePool and the headless Service that gives discovery its pods. */}}
{{- define "kvgate.poolName" -}}
{{- printf "%s-pool" (include "kvgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.engineNamespace" -}}
{{- if .Values.epp.enabled -}}
{{- .Release.Namespace -}}
{{- else -}}
{{- default .Release.Namespace .Values.config.discovery_namespace -}}
{{- end -}}
{{- end -}}

{{/* A shared Redis is configured, in the chart or outside it. */}}
{{- define "kvgate.sharesRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.external.url .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* The chart's Secret holds the password of the in-chart Redis and billing store (given, or
generated at install). */}}
{{- define "kvgate.redisPassword" -}}
{{- if or .Values.redis.enabled .Values.billing.store.enabled -}}true{{- end -}}
{{- end -}}

{{/* The chart's Secret holds the picker's token (epp_token). */}}
{{- define "kvgate.eppToken" -}}
{{- if and .Values.epp.enabled .Values.epp.token -}}true{{- end -}}
{{- end -}}

{{- define "kvgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The settings file: `config` verbatim plus what the chart decides. */}}
{{- define "kvgate.settings" -}}
{{- $settings := deepCopy .Values.config -}}
{{- $_ := set $settings "host" "0.0.0.0" -}}
{{- $_ := set $settings "port" (int .Values.service.httpPort) -}}
{{- if .Values.service.grpcPort -}}
{{- $_ := set $settings "grpc_port" (int .Values.service.grpcPort) -}}
{{- end -}}
{{- if .Values.metricsPort -}}
{{- $_ := set $settings "metrics_port" (int .Values.metricsPort) -}}
{{- else -}}
{{- $_ := set $settings "metrics_port" nil -}}
{{- end -}}
{{- $_ := set $settings "server_secret_file" "/etc/kvgate/secret/server-secret" -}}
{{- $_ := set $settings "tenants_file" "/etc/kvgate/secret/tenants.yaml" -}}
{{- $_ := set $settings "shutdown_grace_s" (include "kvgate.drainGrace" . | int) -}}
{{- $_ := set $settings "workers" (include "kvgate.workers" . | int) -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.cluster -}}
{{- $_ := set $settings "redis_cluster" true -}}
{{- end -}}
{{- if .Values.epp.enabled -}}
{{- /* the picker: its endpoints are the InferencePool's pods, through the pool's Service */ -}}
{{- $_ := set $settings "mode" "epp" -}}
{{- $_ := set $settings "epp_port" (int .Values.epp.port) -}}
{{- $_ := set $settings "discovery" "kubernetes" -}}
{{- $_ := set $settings "discovery_label_selector" (printf "kubernetes.io/service-name=%s" (include "kvgate.poolName" .)) -}}
{{- $_ := set $settings "discovery_port_name" "http" -}}
{{- $_ := unset $settings "discovery_namespace" -}}
{{- end -}}
{{- toYaml $settings -}}
{{- end -}}

{{/*
The gateway's drain grace (shutdown_grace_s): what the pod's termination grace leaves after the
preStop sleep and the stop that follows the drain (flushing billing and the directory,
`drainMarginSeconds`). The kubelet counts the preStop sleep inside terminationGracePeriodSeconds.
*/}}
{{- define "kvgate.drainGrace" -}}
{{- $grace := sub (sub (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds)) (int .Values.drainMarginSeconds) -}}
{{- if lt $grace 1 -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) + drainMarginSeconds (%d): the gateway needs a drain grace of at least 1 s" (int .Values.terminationGracePeriodSeconds) (int .Values.preStopSleepSeconds) (int .Values.drainMarginSeconds)) -}}
{{- end -}}
{{- $grace -}}
{{- end -}}

{{/*
Gateway processes per pod: `workers`, or one per requested CPU rounded up ("1500m" → 2, "2" →
2; no request → 1). More than one must share a directory (docs/operations.md#workers).
*/}}
{{- define "kvgate.workers" -}}
{{- $workers := 1 -}}
{{- if .Values.workers -}}
{{- $workers = int .Values.workers -}}
{{- else -}}
{{- $cpu := toString (dig "requests" "cpu" "1" (.Values.resources | default dict)) -}}
{{- if hasSuffix "m" $cpu -}}
{{- $workers = div (add (trimSuffix "m" $cpu | atoi) 999) 1000 | int -}}
{{- else -}}
{{- $workers = ceil (float64 $cpu) | int -}}
{{- end -}}
{{- end -}}
{{- if lt $workers 1 -}}{{- $workers = 1 -}}{{- end -}}
{{- if and (gt $workers 1) (not (include "kvgate.sharesRedis" .)) -}}
{{- fail (printf "workers: %d needs a shared Redis (redis.enabled, or redis.external): workers with directories of their own would not agree on placement" $workers) -}}
{{- end -}}
{{- $workers -}}
{{- end -}}
