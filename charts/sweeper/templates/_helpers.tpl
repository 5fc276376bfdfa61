{{/*
Chart name, truncated to a DNS label.
*/}}
{{- define "sweeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: <release>-<chart>, or the release name when it already
contains the chart name. Truncated to leave room for the "-worker"/"-migrate" suffixes.
*/}}
{{- define "sweeper.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Names of the per-component resources. */}}
{{- define "sweeper.workerName" -}}
{{- printf "%s-worker" (include "sweeper.fullname" .) }}
{{- end }}

{{- define "sweeper.migrationName" -}}
{{- printf "%s-migrate" (include "sweeper.fullname" .) }}
{{- end }}

{{/* A CronJob name leaves 11 characters for the Job suffix the controller appends. */}}
{{- define "sweeper.cronjobName" -}}
{{- printf "%s-run" (include "sweeper.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "sweeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels. Call with (dict "root" $ "component" "api").
*/}}
{{- define "sweeper.labels" -}}
helm.sh/chart: {{ include "sweeper.chart" .root }}
{{ include "sweeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: sweeper
{{- end }}

{{/*
Selector labels. Call with (dict "root" $ "component" "api").
*/}}
{{- define "sweeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sweeper.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The Secret holding the database URL and the API tokens. */}}
{{- define "sweeper.secretName" -}}
{{- default (include "sweeper.fullname" .) .Values.existingSecret }}
{{- end }}

{{/*
Name of the example RabbitmqCluster: rabbitmqCluster.name or "<fullname>-rabbitmq", at most
42 characters (the operator derives e.g. the StatefulSet "<name>-server" and its pods'
revision-hash label from it, which must fit 63).
*/}}
{{- define "sweeper.rabbitmqClusterName" -}}
{{- default (printf "%s-rabbitmq" (include "sweeper.fullname" .) | trunc 42 | trimSuffix "-") .Values.rabbitmqCluster.name }}
{{- end }}

{{/*
Where SWEEPER_BROKER_URL comes from, as YAML {name, key}: broker.existingSecret and
broker.urlKey; else, with rabbitmqCluster.enabled, the Secret the RabbitMQ Cluster Operator
writes for the cluster's default user, whose connection_string key (operator 2.11.0 on) is
the whole amqp(s):// URL. Execution rabbitmq with neither fails the render.
*/}}
{{- define "sweeper.brokerUrlSecret" -}}
{{- if .Values.broker.existingSecret }}
name: {{ .Values.broker.existingSecret | quote }}
key: {{ .Values.broker.urlKey | quote }}
{{- else if .Values.rabbitmqCluster.enabled }}
name: {{ printf "%s-default-user" (include "sweeper.rabbitmqClusterName" .) | quote }}
key: connection_string
{{- else }}
{{- fail "broker.execution=rabbitmq needs the broker URL (SWEEPER_BROKER_URL) from a Secret: set broker.existingSecret (and broker.urlKey) to an existing Secret with the amqp:// or amqps:// URL, or rabbitmqCluster.enabled=true to use the RabbitMQ Cluster Operator's Secret" }}
{{- end }}
{{- end }}

{{/*
The egress rule to the broker (AMQP 5672, AMQPS 5671) of the API and worker policies, in
execution rabbitmq when networkPolicy.egress closes egress: to networkPolicy.brokerTo; else
to the RabbitmqCluster's pods (the operator labels them with its name and component
rabbitmq) when Sweeper reads the operator's Secret; else to any destination on those ports.
*/}}
{{- define "sweeper.brokerEgress" -}}
- ports:
    - port: 5672
      protocol: TCP
    - port: 5671
      protocol: TCP
  {{- if .Values.networkPolicy.brokerTo }}
  to:
    {{- toYaml .Values.networkPolicy.brokerTo | nindent 4 }}
  {{- else if and .Values.rabbitmqCluster.enabled (not .Values.broker.existingSecret) }}
  to:
    - podSelector:
        matchLabels:
          app.kubernetes.io/name: {{ include "sweeper.rabbitmqClusterName" . }}
          app.kubernetes.io/component: rabbitmq
  {{- end }}
{{- end }}

{{- define "sweeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sweeper.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Sweeper image reference: repository@digest or repository:tag. */}}
{{- define "sweeper.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Name of the HTTP port: "https" when Sweeper terminates TLS itself. */}}
{{- define "sweeper.portName" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{- define "sweeper.scheme" -}}
{{- if .Values.tls.enabled }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{/* Where the policies ConfigMap is mounted, and the file SWEEPER_POLICIES_FILE names. */}}
{{- define "sweeper.policiesDir" -}}/etc/sweeper/policies{{- end }}
{{- define "sweeper.policiesFile" -}}/etc/sweeper/policies/policies.toml{{- end }}
{{- define "sweeper.tlsDir" -}}/etc/sweeper/tls{{- end }}
{{- define "sweeper.signingDir" -}}/etc/sweeper/evidence-signing{{- end }}

{{/*
terminationGracePeriodSeconds: explicit, or preStop sleep + shutdown grace + 10 s.
An explicit value that would cut the drain short fails the render.
*/}}
{{- define "sweeper.terminationGracePeriodSeconds" -}}
{{- $drain := add (int .Values.preStopSleepSeconds) (int (ceil .Values.config.shutdownGraceSeconds)) }}
{{- if .Values.terminationGracePeriodSeconds }}
{{- if le (int .Values.terminationGracePeriodSeconds) (int $drain) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be greater than preStopSleepSeconds + config.shutdownGraceSeconds (%v)" .Values.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- else }}
{{- add $drain 10 }}
{{- end }}
{{- end }}

{{/*
Settings shared by every Sweeper process (API, worker, migration).
New integer settings go through int64: Helm reads numbers as floats, and a float of 1000000
or more prints as e.g. "1e+06", which Sweeper refuses for an integer (the maximums of the
older integer settings here stay below that).
*/}}
{{- define "sweeper.commonEnv" -}}
- name: SWEEPER_ENVIRONMENT
  value: {{ .Values.config.environment | quote }}
- name: SWEEPER_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "sweeper.secretName" . }}
      key: {{ .Values.secretKeys.databaseUrl }}
- name: SWEEPER_API_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "sweeper.secretName" . }}
      key: {{ .Values.secretKeys.apiTokens }}
- name: SWEEPER_OPERATOR_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "sweeper.secretName" . }}
      key: {{ .Values.secretKeys.operatorTokens }}
      optional: true
- name: SWEEPER_VIEWER_TOKENS
  valueFrom:
    secretKeyRef:
      name: {{ include "sweeper.secretName" . }}
      key: {{ .Values.secretKeys.viewerTokens }}
      optional: true
- name: SWEEPER_DATA_DIR
  value: /var/lib/sweeper
- name: SWEEPER_DB_POOL_SIZE
  value: {{ .Values.config.dbPoolSize | quote }}
- name: SWEEPER_DB_POOL_TIMEOUT_SECONDS
  value: {{ .Values.config.dbPoolTimeoutSeconds | quote }}
- name: SWEEPER_DB_STATEMENT_TIMEOUT_MS
  value: {{ .Values.config.dbStatementTimeoutMs | int64 | quote }}
- name: SWEEPER_LOG_LEVEL
  value: {{ .Values.config.logLevel | quote }}
- name: SWEEPER_LOG_FORMAT
  value: {{ .Values.config.logFormat | quote }}
- name: SWEEPER_SHUTDOWN_GRACE_SECONDS
  value: {{ .Values.config.shutdownGraceSeconds | quote }}
- name: SWEEPER_MIGRATE_ON_START
  value: {{ ternary "false" "true" .Values.migration.enabled | quote }}
{{- end }}

{{/*
Settings of the long-running processes (API and worker): the policies file, batching, the
region (only when set: unset, the workers serve the tenants pinned to no region), the
credentials key (the API stores credentials with it, the workers read them) and, in execution
rabbitmq, the broker (the API pods run the leader's relay, the workers consume).
*/}}
{{- define "sweeper.runtimeEnv" -}}
- name: SWEEPER_POLICIES_FILE
  value: {{ include "sweeper.policiesFile" . }}
- name: SWEEPER_BATCH_SIZE
  value: {{ .Values.config.batchSize | quote }}
{{- with .Values.region }}
- name: SWEEPER_REGION
  value: {{ . | quote }}
{{- end }}
{{- if eq .Values.broker.execution "rabbitmq" }}
{{- $url := include "sweeper.brokerUrlSecret" . | fromYaml }}
- name: SWEEPER_EXECUTION
  value: "rabbitmq"
- name: SWEEPER_BROKER_URL
  valueFrom:
    secretKeyRef:
      name: {{ $url.name | quote }}
      key: {{ $url.key | quote }}
- name: SWEEPER_BROKER_PREFETCH
  value: {{ .Values.broker.prefetch | int64 | quote }}
{{- end }}
{{- with .Values.credentialsKey }}
{{- if .secretName }}
- name: SWEEPER_CREDENTIALS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .key }}
{{- if .previousKeysKey }}
- name: SWEEPER_CREDENTIALS_PREVIOUS_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .previousKeysKey }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Settings only `sweeper serve` reads (the API Deployment, with or without --api-only): the
evidence signing key (exports are served by the API), the webhook intake, the HTTP
server's limits and self-retention. `sweeper worker` runs none of
them (its /metrics server is prometheus_client's own). Integers go through int64, as in
sweeper.commonEnv.
*/}}
{{- define "sweeper.apiEnv" -}}
{{- if .Values.evidenceSigning.secretName }}
- name: SWEEPER_EVIDENCE_SIGNING_KEY_FILE
  value: {{ printf "%s/%s" (include "sweeper.signingDir" .) .Values.evidenceSigning.key }}
{{- end }}
{{- with .Values.evidenceSigning.previousPublicKeys }}
- name: SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS
  value: {{ join "," . | quote }}
{{- end }}
- name: SWEEPER_WEBHOOK_MAX_IN_FLIGHT
  value: {{ .Values.config.webhookMaxInFlight | int64 | quote }}
- name: SWEEPER_WEBHOOK_DB_POOL_SIZE
  value: {{ .Values.config.webhookDbPoolSize | int64 | quote }}
- name: SWEEPER_MAX_BODY_BYTES
  value: {{ .Values.config.maxBodyBytes | int64 | quote }}
- name: SWEEPER_BODY_READ_TIMEOUT_SECONDS
  value: {{ .Values.config.bodyReadTimeoutSeconds | quote }}
- name: SWEEPER_HEADER_READ_TIMEOUT_SECONDS
  value: {{ .Values.config.headerReadTimeoutSeconds | quote }}
- name: SWEEPER_MAX_CONNECTIONS
  value: {{ .Values.config.maxConnections | int64 | quote }}
- name: SWEEPER_RETENTION_DAYS
  value: {{ .Values.config.retentionDays | quote }}
- name: SWEEPER_RETENTION_BATCH_SIZE
  value: {{ .Values.config.retentionBatchSize | int64 | quote }}
- name: SWEEPER_RETENTION_INTERVAL_SECONDS
  value: {{ .Values.config.retentionIntervalSeconds | quote }}
{{- if and .Values.ingress.enabled .Values.ingress.tls }}
{{- /* the ingress terminates TLS from outside FORWARDED_ALLOW_IPS: console cookies
       are marked Secure on every request */}}
- name: SWEEPER_CONSOLE_SECURE_COOKIES
  value: "true"
{{- end }}
{{- end }}

{{/* Writable scratch volumes; the root filesystem is read-only. */}}
{{- define "sweeper.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.volumes.tmpSizeLimit }}
- name: data
  emptyDir:
    sizeLimit: {{ .Values.volumes.dataSizeLimit }}
{{- end }}

{{- define "sweeper.scratchVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: data
  mountPath: /var/lib/sweeper
{{- end }}

{{/*
Volumes of the long-running pods: scratch, policies, TLS and the evidence signing key (API
only), extras.
Call with (dict "root" $ "component" "api").
*/}}
{{- define "sweeper.volumes" -}}
{{- $root := .root -}}
{{ include "sweeper.scratchVolumes" $root }}
- name: policies
  configMap:
    name: {{ include "sweeper.fullname" $root }}-policies
{{- if and $root.Values.tls.enabled (eq .component "api") }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" $root.Values.tls.secretName }}
{{- end }}
{{- if and $root.Values.evidenceSigning.secretName (eq .component "api") }}
- name: evidence-signing
  secret:
    secretName: {{ $root.Values.evidenceSigning.secretName }}
    defaultMode: 0440  # read-only, to the pod's fsGroup (Sweeper's group)
    items:
      - key: {{ $root.Values.evidenceSigning.key }}
        path: {{ $root.Values.evidenceSigning.key }}
{{- end }}
{{- with $root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "sweeper.volumeMounts" -}}
{{- $root := .root -}}
{{ include "sweeper.scratchVolumeMounts" $root }}
- name: policies
  mountPath: {{ include "sweeper.policiesDir" $root }}
  readOnly: true
{{- if and $root.Values.tls.enabled (eq .component "api") }}
- name: tls
  mountPath: {{ include "sweeper.tlsDir" $root }}
  readOnly: true
{{- end }}
{{- if and $root.Values.evidenceSigning.secretName (eq .component "api") }}
- name: evidence-signing
  mountPath: {{ include "sweeper.signingDir" $root }}
  readOnly: true
{{- end }}
{{- with $root.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Scheduling constraints shared by the Sweeper pods. Call with (dict "root" $ "component" "api").
*/}}
{{- define "sweeper.scheduling" -}}
{{- $root := .root -}}
enableServiceLinks: false
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $root.Values.topologySpreadConstraints }}
topologySpreadConstraints:
{{- range $root.Values.topologySpreadConstraints }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "sweeper.selectorLabels" $ | fromYaml)) }}
{{- end }}
  - {{ toYaml $constraint | indent 4 | trim }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the Sweeper pods. */}}
{{- define "sweeper.podCommon" -}}
serviceAccountName: {{ include "sweeper.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}
