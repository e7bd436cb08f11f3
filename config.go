package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"
)

// configFileName is read from the working directory when KUMIKO_CONFIG is unset.
const configFileName = "kumiko.config.yaml"

// redactedMark stands in for a secret in the startup log.
const redactedMark = "[redacted]"

// config is the service configuration. loadConfig fills it from, in rising
// precedence, built-in defaults, kumiko.config.yaml and the environment.
type config struct {
	InstanceID    string // names this replica in leader election, heartbeats and logs
	HTTPAddr      string // public API listener
	OpsAddr       string // health, readiness and metrics listener
	LogFormat     string // "text" or "json"
	AdminToken    string // bearer token for the admin routes; empty turns them off
	DatabaseURL   string // postgres:// URL
	RedisURL      string // redis://, rediss:// or unix:// URL
	Search        searchConfig
	Storage       storageConfig
	MasterKey     string // decoded and checked where it is used, not here
	MasterKeyFile string // alternative to MasterKey, for mounted secrets
	Outbox        outboxConfig
	SSE           sseConfig
	Jobs          jobsConfig
	HTTP          httpConfig
	Lifecycle     lifecycleConfig
}

type outboxConfig struct {
	BatchSize    uint          // events claimed and delivered per transaction
	PollInterval time.Duration // fallback when no NOTIFY arrives
	Listen       bool          // LISTEN for inserts; off behind PgBouncer in transaction mode
	MaxAttempts  uint          // failed deliveries before an event is dead
	RetryBase    time.Duration // first delay after a failed delivery; doubles
	RetryMax     time.Duration // cap on that delay
	Retention    time.Duration // delivered events older than this are deleted (dead ones are kept)
	PurgeCron    string        // when the leader enqueues the retention job
}

type jobsConfig struct {
	Workers      uint          // jobs worked at once by this instance
	PollInterval time.Duration // River's fetch poll, the fallback to its LISTEN
	Timeout      time.Duration // a job running longer is cancelled
	RescueAfter  time.Duration // a job still running after this belonged to a crashed worker: run it again
	ReportCron   string        // when the leader enqueues the periodic report
}

type sseConfig struct {
	MaxStreams uint          // open event streams per instance; beyond, 503
	Heartbeat  time.Duration // comment lines that keep idle proxies from closing a stream
	RetryHint  time.Duration // the retry: a client waits before reconnecting
	// A write (replay, event, ping, goodbye) that cannot reach the client within
	// this ends the stream, so a reader that stopped reading cannot pin a handler.
	WriteTimeout    time.Duration
	MaxStreamsPerIP uint // open streams per client address; beyond, 429; 0 turns the cap off
}

// httpConfig bounds what a client can hold on both listeners and how fast one
// client IP may call the public API.
type httpConfig struct {
	ReadHeaderTimeout time.Duration // slowloris: the request headers must arrive within this
	ReadTimeout       time.Duration // body read deadline of a non-streaming request
	IdleTimeout       time.Duration // an idle keep-alive connection is closed after this
	RateLimit         uint          // API requests per second per client IP; 0 turns the limit off
	RateBurst         uint          // requests one client IP may send at once
	SlowMax           time.Duration // cap on GET /api/slow?ms=
	DemoEndpoints     bool          // serve /api/slow; off in production manifests
	// Proxies whose X-Forwarded-For is believed (the load balancer): behind
	// them, the client address of the rate limit and the stream cap is the
	// one they forwarded. Empty: the connection's own address, always.
	TrustedProxies []netip.Prefix
}

type searchConfig struct {
	URL    string // Meilisearch; empty turns search off
	APIKey string
}

type storageConfig struct {
	Endpoint  string // S3 host:port; empty turns object storage off
	AccessKey string
	SecretKey string
	Bucket    string
	UseSSL    bool
}

type lifecycleConfig struct {
	StartupTimeout  time.Duration // from start to ready
	ShutdownTimeout time.Duration // from the stop signal to exit
	Linger          time.Duration // keep serving after turning unready, so load balancers notice
	DrainTimeout    time.Duration // wait for in-flight requests
	PhaseTimeout    time.Duration // any single startup or shutdown phase

	ConnectMaxWait   time.Duration // give up on an unreachable dependency after this
	ConnectRetryBase time.Duration // first retry delay; doubles on each attempt
	ConnectRetryMax  time.Duration // cap on a single retry delay

	Migrations     migrationsConfig
	LeaderElection leaderElectionConfig
	Heartbeat      heartbeatConfig
	Readiness      readinessConfig
}

type migrationsConfig struct {
	Mode           string // "exit-on-pending", "auto-apply" or "warn-on-pending"
	SchemaBaseline uint   // a migration version; 0 means off
}

type leaderElectionConfig struct {
	Enabled       bool
	LockTTL       time.Duration
	RenewInterval time.Duration
}

type heartbeatConfig struct {
	Interval time.Duration
	TTL      time.Duration
}

type readinessConfig struct {
	ProbeTimeout time.Duration
	CacheTTL     time.Duration // reuse a probe result this long, so frequent polling stays cheap
}

func defaultConfig() config {
	return config{
		HTTPAddr:  ":8080",
		OpsAddr:   ":9090",
		LogFormat: "text",
		Storage:   storageConfig{Bucket: "kumiko-demo"},
		Outbox: outboxConfig{BatchSize: 100, PollInterval: time.Second, Listen: true, MaxAttempts: 10,
			RetryBase: time.Second, RetryMax: 5 * time.Minute, Retention: 7 * 24 * time.Hour, PurgeCron: "@hourly"},
		HTTP: httpConfig{ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 15 * time.Second, IdleTimeout: 60 * time.Second,
			RateLimit: 500, RateBurst: 1000, SlowMax: 60 * time.Second, DemoEndpoints: true},
		SSE: sseConfig{MaxStreams: 5000, Heartbeat: 15 * time.Second, RetryHint: time.Second,
			WriteTimeout: 10 * time.Second, MaxStreamsPerIP: 20},
		Jobs: jobsConfig{Workers: 10, PollInterval: time.Second, Timeout: time.Minute, RescueAfter: time.Hour,
			ReportCron: "*/5 * * * *"},
		Lifecycle: lifecycleConfig{
			StartupTimeout:   120 * time.Second,
			ShutdownTimeout:  40 * time.Second,
			Linger:           3 * time.Second,
			DrainTimeout:     30 * time.Second,
			PhaseTimeout:     30 * time.Second,
			ConnectMaxWait:   5 * time.Minute,
			ConnectRetryBase: 1 * time.Second,
			ConnectRetryMax:  30 * time.Second,
			Migrations:       migrationsConfig{Mode: "exit-on-pending"},
			LeaderElection: leaderElectionConfig{
				Enabled:       true,
				LockTTL:       15 * time.Second,
				RenewInterval: 5 * time.Second,
			},
			Heartbeat: heartbeatConfig{Interval: 5 * time.Second, TTL: 10 * time.Second},
			Readiness: readinessConfig{ProbeTimeout: 1 * time.Second, CacheTTL: 1 * time.Second},
		},
	}
}

// configSetting ties one config field to its names in the file and the environment.
type configSetting struct {
	yaml  string       // dotted path in kumiko.config.yaml
	env   string       // environment variable
	value settingValue // parses into the config field and renders it for the log
}

// settings is the one place where every setting is named. The values point
// into c, so setting one writes the config.
func (c *config) settings() []configSetting {
	l := &c.Lifecycle
	migrationModes := []string{"exit-on-pending", "auto-apply", "warn-on-pending"}
	return []configSetting{
		{"instanceId", "KUMIKO_INSTANCE_ID", textValue{p: &c.InstanceID}},
		{"http.addr", "KUMIKO_HTTP_ADDR", addrValue{p: &c.HTTPAddr}},
		{"ops.addr", "KUMIKO_OPS_ADDR", addrValue{p: &c.OpsAddr}},
		{"log.format", "KUMIKO_LOG_FORMAT", choiceValue{p: &c.LogFormat, allowed: []string{"text", "json"}}},
		{"admin.token", "KUMIKO_ADMIN_TOKEN", secretValue{p: &c.AdminToken, minLen: 16}},
		{"database.url", "DATABASE_URL", urlValue{p: &c.DatabaseURL, schemes: []string{"postgres", "postgresql"}}},
		{"redis.url", "REDIS_URL", urlValue{p: &c.RedisURL, schemes: []string{"redis", "rediss", "unix"}}},
		{"search.url", "MEILI_URL", urlValue{p: &c.Search.URL, schemes: []string{"http", "https"}}},
		{"search.apiKey", "MEILI_API_KEY", secretValue{p: &c.Search.APIKey}},
		{"storage.endpoint", "S3_ENDPOINT", addrValue{p: &c.Storage.Endpoint, optional: true}},
		{"storage.accessKey", "S3_ACCESS_KEY", secretValue{p: &c.Storage.AccessKey}},
		{"storage.secretKey", "S3_SECRET_KEY", secretValue{p: &c.Storage.SecretKey}},
		{"storage.bucket", "S3_BUCKET", textValue{p: &c.Storage.Bucket}},
		{"storage.useSSL", "S3_USE_SSL", boolValue{p: &c.Storage.UseSSL}},
		{"secrets.masterKey", "KUMIKO_MASTER_KEY", secretValue{p: &c.MasterKey}},
		{"secrets.masterKeyFile", "KUMIKO_MASTER_KEY_FILE", textValue{p: &c.MasterKeyFile}},
		{"outbox.batchSize", "KUMIKO_OUTBOX_BATCH_SIZE", uintValue{p: &c.Outbox.BatchSize}},
		{"outbox.pollIntervalSec", "KUMIKO_OUTBOX_POLL_INTERVAL", durationValue{p: &c.Outbox.PollInterval}},
		{"outbox.listen", "KUMIKO_OUTBOX_LISTEN", boolValue{p: &c.Outbox.Listen}},
		{"outbox.maxAttempts", "KUMIKO_OUTBOX_MAX_ATTEMPTS", uintValue{p: &c.Outbox.MaxAttempts}},
		{"outbox.retryBaseSec", "KUMIKO_OUTBOX_RETRY_BASE", durationValue{p: &c.Outbox.RetryBase}},
		{"outbox.retryMaxSec", "KUMIKO_OUTBOX_RETRY_MAX", durationValue{p: &c.Outbox.RetryMax}},
		{"outbox.retentionSec", "KUMIKO_OUTBOX_RETENTION", durationValue{p: &c.Outbox.Retention}},
		{"outbox.purgeCron", "KUMIKO_OUTBOX_PURGE_CRON", textValue{p: &c.Outbox.PurgeCron}},
		{"jobs.workers", "KUMIKO_JOBS_WORKERS", uintValue{p: &c.Jobs.Workers}},
		{"jobs.pollIntervalSec", "KUMIKO_JOBS_POLL_INTERVAL", durationValue{p: &c.Jobs.PollInterval}},
		{"jobs.timeoutSec", "KUMIKO_JOBS_TIMEOUT", durationValue{p: &c.Jobs.Timeout}},
		{"jobs.rescueAfterSec", "KUMIKO_JOBS_RESCUE_AFTER", durationValue{p: &c.Jobs.RescueAfter}},
		{"jobs.reportCron", "KUMIKO_REPORT_CRON", textValue{p: &c.Jobs.ReportCron}},
		{"http.readHeaderTimeoutSec", "KUMIKO_HTTP_READ_HEADER_TIMEOUT", durationValue{p: &c.HTTP.ReadHeaderTimeout}},
		{"http.readTimeoutSec", "KUMIKO_HTTP_READ_TIMEOUT", durationValue{p: &c.HTTP.ReadTimeout}},
		{"http.idleTimeoutSec", "KUMIKO_HTTP_IDLE_TIMEOUT", durationValue{p: &c.HTTP.IdleTimeout}},
		{"http.rateLimit", "KUMIKO_API_RATE_LIMIT", uintValue{p: &c.HTTP.RateLimit}},
		{"http.rateBurst", "KUMIKO_API_RATE_BURST", uintValue{p: &c.HTTP.RateBurst}},
		{"http.slowMaxSec", "KUMIKO_SLOW_MAX", durationValue{p: &c.HTTP.SlowMax}},
		{"http.demoEndpoints", "KUMIKO_DEMO_ENDPOINTS", boolValue{p: &c.HTTP.DemoEndpoints}},
		{"http.trustedProxies", "KUMIKO_TRUSTED_PROXIES", prefixListValue{p: &c.HTTP.TrustedProxies}},
		{"sse.maxStreams", "KUMIKO_SSE_MAX_STREAMS", uintValue{p: &c.SSE.MaxStreams}},
		{"sse.heartbeatSec", "KUMIKO_SSE_HEARTBEAT", durationValue{p: &c.SSE.Heartbeat}},
		{"sse.retrySec", "KUMIKO_SSE_RETRY", durationValue{p: &c.SSE.RetryHint}},
		{"sse.writeTimeoutSec", "KUMIKO_SSE_WRITE_TIMEOUT", durationValue{p: &c.SSE.WriteTimeout}},
		{"sse.maxStreamsPerIp", "KUMIKO_SSE_MAX_STREAMS_PER_IP", uintValue{p: &c.SSE.MaxStreamsPerIP}},

		{"lifecycle.startupTimeoutSec", "KUMIKO_STARTUP_TIMEOUT", durationValue{p: &l.StartupTimeout}},
		{"lifecycle.shutdownTimeoutSec", "KUMIKO_SHUTDOWN_TIMEOUT", durationValue{p: &l.ShutdownTimeout}},
		{"lifecycle.lingerSec", "KUMIKO_LINGER", durationValue{p: &l.Linger, zeroOK: true}},
		{"lifecycle.drainTimeoutSec", "KUMIKO_DRAIN_TIMEOUT", durationValue{p: &l.DrainTimeout}},
		{"lifecycle.phaseTimeoutSec", "KUMIKO_PHASE_TIMEOUT", durationValue{p: &l.PhaseTimeout}},
		{"lifecycle.connectMaxWaitSec", "KUMIKO_CONNECT_MAX_WAIT", durationValue{p: &l.ConnectMaxWait}},
		{"lifecycle.connectRetryBaseSec", "KUMIKO_CONNECT_RETRY_BASE", durationValue{p: &l.ConnectRetryBase}},
		{"lifecycle.connectRetryMaxSec", "KUMIKO_CONNECT_RETRY_MAX", durationValue{p: &l.ConnectRetryMax}},
		{"lifecycle.migrations.mode", "KUMIKO_MIGRATIONS_MODE", choiceValue{p: &l.Migrations.Mode, allowed: migrationModes}},
		{"lifecycle.migrations.schemaBaseline", "KUMIKO_SCHEMA_BASELINE", uintValue{p: &l.Migrations.SchemaBaseline}},
		{"lifecycle.leaderElection.enabled", "KUMIKO_LEADER_ENABLED", boolValue{p: &l.LeaderElection.Enabled}},
		{"lifecycle.leaderElection.lockTtlSec", "KUMIKO_LEADER_LOCK_TTL", durationValue{p: &l.LeaderElection.LockTTL}},
		{"lifecycle.leaderElection.heartbeatIntervalSec", "KUMIKO_LEADER_RENEW_INTERVAL", durationValue{p: &l.LeaderElection.RenewInterval}},
		{"lifecycle.heartbeat.intervalSec", "KUMIKO_HEARTBEAT_INTERVAL", durationValue{p: &l.Heartbeat.Interval}},
		{"lifecycle.heartbeat.ttlSec", "KUMIKO_HEARTBEAT_TTL", durationValue{p: &l.Heartbeat.TTL}},
		{"lifecycle.readiness.probeTimeoutSec", "KUMIKO_READINESS_PROBE_TIMEOUT", durationValue{p: &l.Readiness.ProbeTimeout}},
		{"lifecycle.readiness.cacheTtlSec", "KUMIKO_READINESS_CACHE_TTL", durationValue{p: &l.Readiness.CacheTTL}},
	}
}

// loadConfig builds the config from defaults, the optional file and the
// environment, and reports every problem it finds in one error, one per line.
// An empty environment variable counts as unset. The environment is read only
// through getenv and files only through readFile (os.ReadFile in production),
// so tests can pass fakes.
func loadConfig(getenv func(string) string, readFile func(string) ([]byte, error)) (config, error) {
	c := defaultConfig()
	fileName, fromFile, problems := readConfigFile(getenv, readFile)

	for _, s := range c.settings() {
		if v, ok := fromFile[s.yaml]; ok {
			if err := s.value.set(v.raw); err != nil {
				problems = append(problems, fmt.Errorf("%s: line %d: %s: %w", fileName, v.line, s.yaml, err))
			}
		}
		if raw := getenv(s.env); raw != "" {
			if err := s.value.set(raw); err != nil {
				problems = append(problems, fmt.Errorf("%s: %w", s.env, err))
			}
		}
	}
	if c.InstanceID == "" {
		c.InstanceID = defaultInstanceID(getenv)
	}
	problems = append(problems, c.validate()...)

	if len(problems) > 0 {
		return config{}, fmt.Errorf("invalid configuration:\n%w", errors.Join(problems...))
	}
	return c, nil
}

// defaultInstanceID names the replica after its host. The random suffix keeps
// two processes on one host, or a restarted pod that kept its name, apart.
func defaultInstanceID(getenv func(string) string) string {
	host := getenv("HOSTNAME")
	if host == "" {
		host, _ = os.Hostname()
	}
	if host == "" {
		host = "kumiko"
	}
	suffix := make([]byte, 3)
	rand.Read(suffix) // never fails: crypto/rand crashes the program rather than return an error
	return host + "-" + hex.EncodeToString(suffix)
}

// validate checks the rules that span several settings or that can only be
// judged once every source has been applied.
func (c *config) validate() []error {
	var problems []error
	check := func(ok bool, format string, args ...any) {
		if !ok {
			problems = append(problems, fmt.Errorf(format, args...))
		}
	}
	l, le, hb := c.Lifecycle, c.Lifecycle.LeaderElection, c.Lifecycle.Heartbeat

	check(c.DatabaseURL != "", "DATABASE_URL is required (database.url in the config file)")
	check(c.RedisURL != "", "REDIS_URL is required (redis.url in the config file)")

	// Port 0 asks the kernel for a free port, so two ":0" listeners never collide.
	httpPort, opsPort := portOf(c.HTTPAddr), portOf(c.OpsAddr)
	check(httpPort != opsPort || httpPort == "0" || httpPort == "",
		"http.addr (%s) and ops.addr (%s) must use different ports", c.HTTPAddr, c.OpsAddr)

	s := c.Storage
	check(s.Endpoint == "" || (s.AccessKey != "" && s.SecretKey != ""),
		"storage.accessKey and storage.secretKey (S3_ACCESS_KEY, S3_SECRET_KEY) are required when storage.endpoint is set")
	check(s.Endpoint == "" || s.Bucket != "", "storage.bucket must not be empty when storage.endpoint is set")
	check(c.MasterKey == "" || c.MasterKeyFile == "",
		"secrets.masterKey and secrets.masterKeyFile (KUMIKO_MASTER_KEY, KUMIKO_MASTER_KEY_FILE) are both set; set only one")

	check(l.DrainTimeout+l.Linger < l.ShutdownTimeout,
		"lifecycle.shutdownTimeoutSec (%s) must be longer than drainTimeoutSec + lingerSec (%s + %s): "+
			"the rest of the shutdown, stopping workers and closing connections, needs time after the drain",
		l.ShutdownTimeout, l.DrainTimeout, l.Linger)
	check(l.ConnectRetryBase <= l.ConnectRetryMax,
		"lifecycle.connectRetryBaseSec (%s) must not exceed connectRetryMaxSec (%s), the cap on a single delay",
		l.ConnectRetryBase, l.ConnectRetryMax)
	// Renewing at most every TTL/2 survives one late renewal; renewing every
	// TTL or less often loses the lock between renewals.
	check(!le.Enabled || le.RenewInterval < le.LockTTL,
		"lifecycle.leaderElection.heartbeatIntervalSec (%s) must be less than lockTtlSec (%s), ideally at most half, "+
			"or the leader loses the lock between renewals", le.RenewInterval, le.LockTTL)
	check(c.Outbox.BatchSize >= 1 && c.Outbox.BatchSize <= 10000, "outbox.batchSize (%d) must be from 1 to 10000", c.Outbox.BatchSize)
	check(c.Outbox.MaxAttempts >= 1, "outbox.maxAttempts must be at least 1")
	check(c.Outbox.RetryBase <= c.Outbox.RetryMax, "outbox.retryBaseSec (%s) must not exceed retryMaxSec (%s)", c.Outbox.RetryBase, c.Outbox.RetryMax)
	check(c.HTTP.RateLimit == 0 || c.HTTP.RateBurst >= 1, "http.rateBurst must be at least 1 when http.rateLimit is set")
	check(c.SSE.MaxStreams >= 1, "sse.maxStreams must be at least 1")
	check(c.Jobs.Workers >= 1, "jobs.workers must be at least 1")
	// River rescues a job still running after RescueAfter: a shorter value
	// would run live jobs twice.
	check(c.Jobs.Timeout < c.Jobs.RescueAfter, "jobs.timeoutSec (%s) must be shorter than rescueAfterSec (%s)", c.Jobs.Timeout, c.Jobs.RescueAfter)
	check(hb.Interval < hb.TTL,
		"lifecycle.heartbeat.intervalSec (%s) must be less than ttlSec (%s), or the heartbeat expires between beats",
		hb.Interval, hb.TTL)
	return problems
}

// portOf returns the port of a host:port address, or "" if it has none.
func portOf(addr string) string {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	return port
}

// logFields returns the config as fields for one startup log line, keyed like
// the file. Secrets are masked.
func (c config) logFields() map[string]any {
	fields := make(map[string]any)
	for _, s := range c.settings() {
		fields[s.yaml] = s.value.logValue()
	}
	return fields
}

// secrets returns every secret value that is set, so a log hook can scrub
// them from any line.
func (c config) secrets() []string {
	var secrets []string
	for _, s := range c.settings() {
		if h, ok := s.value.(secretHolder); ok {
			secrets = append(secrets, h.secrets()...)
		}
	}
	return secrets
}

// The config file.

// fileValue is one value from the file as written (3, 0.5 and "250ms" alike),
// with its line for error messages.
type fileValue struct {
	raw  string
	line int
}

// readConfigFile reads the config file and returns its name for error
// messages, the values it sets keyed by dotted path ("lifecycle.lingerSec"),
// and every problem found in it. The settings table is the schema: a key it
// does not name is an error, so a misspelt key never silently does nothing.
func readConfigFile(getenv func(string) string, readFile func(string) ([]byte, error)) (string, map[string]fileValue, []error) {
	name, explicit := getenv("KUMIKO_CONFIG"), true
	if name == "" {
		name, explicit = configFileName, false
	}
	data, err := readFile(name)
	if err != nil {
		if !explicit && errors.Is(err, fs.ErrNotExist) {
			return name, nil, nil // the file is optional unless asked for by name
		}
		if explicit {
			err = fmt.Errorf("KUMIKO_CONFIG: %w", err)
		}
		return name, nil, []error{err}
	}

	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
		return name, nil, nil // an empty file sets nothing
	} else if err != nil {
		return name, nil, []error{fmt.Errorf("%s: %w", name, err)} // malformed YAML
	}
	var problems []error
	if !errors.Is(dec.Decode(new(yaml.Node)), io.EOF) {
		problems = append(problems, fmt.Errorf("%s: only one YAML document is allowed", name))
	}

	leaves, sections := map[string]bool{}, map[string]bool{}
	var c config
	for _, s := range c.settings() {
		leaves[s.yaml] = true
		for path := s.yaml; strings.Contains(path, "."); {
			path = path[:strings.LastIndex(path, ".")]
			sections[path] = true
		}
	}
	values := map[string]fileValue{}
	var walk func(prefix string, n *yaml.Node)
	walk = func(prefix string, n *yaml.Node) {
		if n.Kind != yaml.MappingNode {
			problems = append(problems, fmt.Errorf("%s: line %d: %sexpected a mapping of keys", name, n.Line, strings.TrimSuffix(prefix, ".")+" "))
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			key, val := n.Content[i], n.Content[i+1]
			path := prefix + key.Value
			switch {
			case sections[path]:
				walk(path+".", val)
			case !leaves[path]:
				problems = append(problems, fmt.Errorf("%s: line %d: unknown key %s", name, key.Line, path))
			case val.Kind != yaml.ScalarNode:
				problems = append(problems, fmt.Errorf("%s: line %d: %s: expected a single value, not a list or mapping", name, val.Line, path))
			case val.Tag != "!!null":
				values[path] = fileValue{raw: val.Value, line: val.Line}
			}
		}
	}
	if len(doc.Content) == 1 {
		walk("", doc.Content[0])
	}
	return name, values, problems
}

// Setting values.

// A settingValue parses text from the file or the environment into one config
// field, and renders that field for the startup log. A rejected string is
// still stored, so that checks such as "is required" don't pile on; the config
// is discarded anyway.
type settingValue interface {
	set(raw string) error
	logValue() any
}

// secretHolder is implemented by the values that can contain secrets.
type secretHolder interface {
	secrets() []string
}

type textValue struct{ p *string }

func (v textValue) set(raw string) error { *v.p = raw; return nil }
func (v textValue) logValue() any        { return *v.p }

type choiceValue struct {
	p       *string
	allowed []string
}

func (v choiceValue) set(raw string) error {
	*v.p = raw
	if !slices.Contains(v.allowed, raw) {
		return fmt.Errorf("%q is not one of %s", raw, strings.Join(v.allowed, ", "))
	}
	return nil
}

func (v choiceValue) logValue() any { return *v.p }

// addrValue is a listen or dial address, host:port. The host may be empty
// (":8080", all interfaces) and the port may be 0 (any free port).
type addrValue struct {
	p        *string
	optional bool // empty means the feature is off
}

func (v addrValue) set(raw string) error {
	*v.p = raw
	if raw == "" && v.optional {
		return nil
	}
	_, port, err := net.SplitHostPort(raw)
	if err != nil {
		return fmt.Errorf("want host:port: %w", err)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("port %q is not a number from 0 to 65535", port)
	}
	return nil
}

func (v addrValue) logValue() any { return *v.p }

// secretValue is a token or key. It never appears in the log or in an error.
type secretValue struct {
	p      *string
	minLen int // in characters, when set
}

func (v secretValue) set(raw string) error {
	*v.p = raw
	if n := utf8.RuneCountInString(raw); raw != "" && n < v.minLen {
		return fmt.Errorf("must be at least %d characters long, got %d", v.minLen, n)
	}
	return nil
}

func (v secretValue) logValue() any {
	if *v.p == "" {
		return ""
	}
	return redactedMark
}

func (v secretValue) secrets() []string {
	if *v.p == "" {
		return nil
	}
	return []string{*v.p}
}

// urlValue is a connection URL, which may embed a password. Errors never
// quote the URL, since they end up in logs.
type urlValue struct {
	p       *string
	schemes []string
}

func (v urlValue) set(raw string) error {
	*v.p = raw
	if raw == "" {
		return nil // optional here; validate insists on the required ones
	}
	u, err := url.Parse(raw)
	if err != nil {
		if urlErr, ok := errors.AsType[*url.Error](err); ok {
			err = urlErr.Err // the *url.Error repeats the whole URL, password included
		}
		return fmt.Errorf("not a valid URL: %w", err)
	}
	if !slices.Contains(v.schemes, u.Scheme) {
		return fmt.Errorf("the URL scheme must be one of %s, got %q", strings.Join(v.schemes, ", "), u.Scheme)
	}
	return nil
}

func (v urlValue) logValue() any     { return redactConnString(*v.p) }
func (v urlValue) secrets() []string { return connPasswords(*v.p) }

type durationValue struct {
	p      *time.Duration
	zeroOK bool // zero is a meaningful setting, not a mistake
}

func (v durationValue) set(raw string) error {
	d, err := parseDuration(raw)
	switch {
	case err != nil:
		return err
	case d < 0:
		return fmt.Errorf("%q is negative", raw)
	case d == 0 && !v.zeroOK:
		return fmt.Errorf("must be greater than zero")
	}
	*v.p = d
	return nil
}

func (v durationValue) logValue() any { return v.p.String() }

// prefixListValue is a comma-separated list of addresses or CIDR ranges
// ("10.0.0.0/8, 127.0.0.1"); a bare address is a range of one.
type prefixListValue struct{ p *[]netip.Prefix }

func (v prefixListValue) set(raw string) error {
	*v.p = nil
	for _, part := range strings.Split(raw, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		prefix, err := netip.ParsePrefix(part)
		if err != nil {
			addr, addrErr := netip.ParseAddr(part)
			if addrErr != nil {
				return fmt.Errorf("%q is neither an address nor a CIDR range", part)
			}
			prefix = netip.PrefixFrom(addr, addr.BitLen())
		}
		*v.p = append(*v.p, prefix.Masked())
	}
	return nil
}

func (v prefixListValue) logValue() any {
	parts := make([]string, len(*v.p))
	for i, p := range *v.p {
		parts[i] = p.String()
	}
	return strings.Join(parts, ",")
}

type boolValue struct{ p *bool }

func (v boolValue) set(raw string) error {
	b, err := strconv.ParseBool(raw)
	if err != nil {
		return fmt.Errorf("want true, false, 1 or 0, got %q", raw)
	}
	*v.p = b
	return nil
}

func (v boolValue) logValue() any { return *v.p }

type uintValue struct{ p *uint }

func (v uintValue) set(raw string) error {
	n, err := strconv.ParseUint(raw, 10, strconv.IntSize)
	if err != nil {
		return fmt.Errorf("want a whole number, 0 or more, got %q", raw)
	}
	*v.p = uint(n)
	return nil
}

func (v uintValue) logValue() any { return *v.p }

// parseDuration parses a Go duration ("250ms", "1m30s") or a bare number of
// seconds ("3", "0.5"), the unit the *Sec setting names promise.
func parseDuration(s string) (time.Duration, error) {
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		ns := math.Round(secs * float64(time.Second))
		// float64(math.MaxInt64) rounds up to 2⁶³, one past the largest Duration.
		if math.IsNaN(ns) || ns >= math.MaxInt64 || ns < math.MinInt64 {
			return 0, fmt.Errorf("%q seconds is out of range", s)
		}
		return time.Duration(ns), nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("%w (want seconds like 3 or 0.5, or a duration like 250ms or 1m30s)", err)
	}
	return d, nil
}

// Connection strings.

// redactConnString returns a connection URL that is safe to log.
func redactConnString(s string) string {
	if s == "" {
		return ""
	}
	u, err := url.Parse(s)
	if err != nil {
		return redactedMark // no telling where a password might be
	}
	// Postgres drivers also take the password as a query parameter.
	if q := u.Query(); q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// connPasswords returns the passwords in a connection URL.
func connPasswords(s string) []string {
	u, err := url.Parse(s)
	if err != nil {
		return nil
	}
	var passwords []string
	if pw, _ := u.User.Password(); pw != "" {
		passwords = append(passwords, pw)
	}
	if pw := u.Query().Get("password"); pw != "" {
		passwords = append(passwords, pw)
	}
	return passwords
}
