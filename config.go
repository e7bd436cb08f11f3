package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// configFileName is read from the working directory when KUMIKO_CONFIG is unset.
const configFileName = "kumiko.config.yaml"

// envPrefix begins the name of every environment variable the service owns:
// one it does not know is a mistake (loadConfig), not something to ignore.
const envPrefix = "KUMIKO_"

// config is the service configuration. loadConfig fills it from, in rising
// precedence, built-in defaults, kumiko.config.yaml and the environment.
// Each field is declared here by name and type only: its file key,
// environment name, default, rules and meaning are its one line in settings().
// The building blocks' settings are declared in their own files, the same
// way, and gathered in blockConfig (app.go).
type config struct {
	InstanceID    string
	HTTPAddr      string
	OpsAddr       string
	LogFormat     string
	AdminToken    string
	DatabaseURL   string
	DB            dbConfig
	MasterKey     string // decoded and checked where it is used, not here
	MasterKeyFile string
	HTTP          httpConfig
	Lifecycle     lifecycleConfig
	Diagnostics   diagnosticsConfig
	UnknownEnv    string // what a KUMIKO_ variable no setting reads does: "error" or "warn"
	blockConfig

	// deprecated lists the old file keys that were read, for phase 1 to warn about.
	deprecated []deprecatedKey
	// unknownEnv lists the unknown KUMIKO_ variables that were set, for phase
	// 1 to warn about when UnknownEnv is "warn".
	unknownEnv []unknownVar
}

// dbConfig bounds every statement on the server's side, where a client's
// deadline cannot reach: a query the client gave up on stops too.
type dbConfig struct {
	StatementTimeout time.Duration
	LockTimeout      time.Duration
	// IdleInTransactionTimeout: no transaction of the service waits between
	// its statements; one that does belongs to a frozen process.
	IdleInTransactionTimeout time.Duration
}

// httpConfig bounds what a client can hold on both listeners and how fast one
// client IP may call the public API.
type httpConfig struct {
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	IdleTimeout       time.Duration
	RateLimit         uint
	RateBurst         uint
	// Admission control (admission.go): the adaptive concurrency limit
	// stays from ConcurrencyMin to ConcurrencyMax (0: off) and shrinks when
	// the median latency passes LatencyTolerance percent of its baseline.
	ConcurrencyMin    uint
	ConcurrencyMax    uint
	LatencyTolerance  uint
	MaxConns          uint // the API listener's open connections, at most (0: no cap)
	MaxConnsPerClient uint // one client address's share of them, trusted proxies exempt (0: no bound)
	DependencyTimeout time.Duration
	SlowMax           time.Duration
	DemoEndpoints     bool
	TrustedProxies    []netip.Prefix
}

type lifecycleConfig struct {
	StartupTimeout            time.Duration
	ShutdownTimeout           time.Duration
	Linger                    time.Duration
	LingerQuiet               time.Duration
	DrainReject               string
	DrainTimeout              time.Duration
	PhaseTimeout              time.Duration
	OptionalDependencyTimeout time.Duration
	ConnectMaxWait            time.Duration
	ConnectRetryBase          time.Duration
	ConnectRetryMax           time.Duration
	Migrations                migrationsConfig
	Readiness                 readinessConfig
}

// diagnosticsConfig is what a drain or a boot that went wrong leaves behind
// (diagnostics.go).
type diagnosticsConfig struct {
	Dir            string
	FlightRecorder bool
	RecorderWindow time.Duration
	RecorderMaxMB  uint
	TerminationLog string
}

type migrationsConfig struct {
	Mode           string
	SchemaBaseline uint
}

type readinessConfig struct {
	ProbeTimeout  time.Duration
	CheckInterval time.Duration
	ProbePeriod   time.Duration
}

// configSetting declares one setting completely. The file key says what the
// environment name says, with no unit in it: every duration takes Go syntax
// (250ms, 1m30s) or bare seconds (3, 0.5).
type configSetting struct {
	key      string       // dotted path in kumiko.config.yaml
	env      string       // environment variable
	def      string       // the default, written as in the file; parsed by value
	value    settingValue // parses into the config field, checks its rules, renders it for the log
	doc      string       // one line for docs/configuration.md and the example file
	required bool         // loading fails while it is empty
	old      string       // a former file key, still read with a warning
}

// settings is the one place where each setting of the core is declared; the
// blocks' follow, each joining the file's section it names (a heartbeat's
// lifecycle.heartbeat.* with the core's lifecycle.*), so the file, the docs
// and the log show each section once. The values point into c, so setting
// one writes the config.
func (c *config) settings() []configSetting {
	return bySection(append(c.coreSettings(), c.blockConfig.settings()...))
}

// bySection sorts settings by the first appearance of their top-level
// section, keeping the order within one.
func bySection(settings []configSetting) []configSetting {
	top := func(key string) string { return strings.SplitN(key, ".", 2)[0] }
	first := map[string]int{}
	for i, s := range settings {
		if _, ok := first[top(s.key)]; !ok {
			first[top(s.key)] = i
		}
	}
	slices.SortStableFunc(settings, func(a, b configSetting) int { return first[top(a.key)] - first[top(b.key)] })
	return settings
}

func (c *config) coreSettings() []configSetting {
	l := &c.Lifecycle
	return []configSetting{
		{key: "instanceId", env: "KUMIKO_INSTANCE_ID", value: textValue{p: &c.InstanceID},
			doc: "names this replica in leader election, heartbeats and logs; empty: the host name plus a random suffix"},
		{key: "log.format", env: "KUMIKO_LOG_FORMAT", def: "text", value: choiceValue{p: &c.LogFormat, allowed: []string{"text", "json"}},
			doc: "log line format"},
		{key: "config.unknownEnv", env: "KUMIKO_UNKNOWN_ENV", def: "error", value: choiceValue{p: &c.UnknownEnv, allowed: []string{"error", "warn"}},
			doc: "a KUMIKO_ variable no setting reads (a typo) stops the boot; warn: boot and log it, where others share the prefix"},

		{key: "http.addr", env: "KUMIKO_HTTP_ADDR", def: ":8080", value: addrValue{p: &c.HTTPAddr},
			doc: "the API listener, bound in phase 15"},
		{key: "http.readHeaderTimeout", env: "KUMIKO_HTTP_READ_HEADER_TIMEOUT", def: "5s", value: durationValue{p: &c.HTTP.ReadHeaderTimeout},
			doc: "request headers must arrive within this (both listeners; slowloris)", old: "http.readHeaderTimeoutSec"},
		{key: "http.readTimeout", env: "KUMIKO_HTTP_READ_TIMEOUT", def: "15s", value: durationValue{p: &c.HTTP.ReadTimeout},
			doc: "body read deadline of a non-streaming request", old: "http.readTimeoutSec"},
		{key: "http.idleTimeout", env: "KUMIKO_HTTP_IDLE_TIMEOUT", def: "60s", value: durationValue{p: &c.HTTP.IdleTimeout},
			doc: "an idle keep-alive connection is closed after this", old: "http.idleTimeoutSec"},
		{key: "http.rateLimit", env: "KUMIKO_API_RATE_LIMIT", def: "500", value: uintValue{p: &c.HTTP.RateLimit},
			doc: "API requests per second per client IP; 0 turns the limit off"},
		{key: "http.rateBurst", env: "KUMIKO_API_RATE_BURST", def: "1000", value: uintValue{p: &c.HTTP.RateBurst},
			doc: "requests one client IP may send at once"},
		{key: "http.concurrencyMax", env: "KUMIKO_API_CONCURRENCY_MAX", def: "500", value: uintValue{p: &c.HTTP.ConcurrencyMax},
			doc: "API requests worked on at once, at most: the ceiling of the adaptive limit, beyond which requests get 503 with Retry-After at once; 0 turns admission control off"},
		{key: "http.concurrencyMin", env: "KUMIKO_API_CONCURRENCY_MIN", def: "32", value: uintValue{p: &c.HTTP.ConcurrencyMin, min: 1},
			doc: "the adaptive limit starts here and never goes below, however slow the requests get"},
		{key: "http.latencyTolerance", env: "KUMIKO_API_LATENCY_TOLERANCE", def: "200", value: uintValue{p: &c.HTTP.LatencyTolerance, min: 101, max: 1000},
			doc: "percent: the limit shrinks while the median API latency is above this share of its long-term baseline; higher trades latency for goodput"},
		{key: "http.maxConns", env: "KUMIKO_API_MAX_CONNS", def: "8192", value: uintValue{p: &c.HTTP.MaxConns},
			doc: "API connections open at once, event streams included; at the cap a new one takes the place of the longest idle keep-alive connection or of one silent (no request header) for " + silentConnGrace.String() + ", and while there is none it waits in the kernel's accept queue, so memory stays bounded however many clients connect; 0 turns the cap off"},
		{key: "http.maxConnsPerClient", env: "KUMIKO_API_MAX_CONNS_PER_CLIENT", def: "1024", value: uintValue{p: &c.HTTP.MaxConnsPerClient},
			doc: "API connections one client address may hold while the cap is on; a further one is closed at once, unanswered; the addresses in KUMIKO_TRUSTED_PROXIES are exempt (every connection through a load balancer has its address); 0 turns the bound off"},
		{key: "http.dependencyTimeout", env: "KUMIKO_HTTP_DEPENDENCY_TIMEOUT", def: "5s", value: durationValue{p: &c.HTTP.DependencyTimeout},
			doc: "one API request's database and Redis calls together; past it, 503 with Retry-After. Seconds, not milliseconds: a slow shared database slows requests down before it fails them; the admission limit, not this budget, protects the instance"},
		{key: "http.slowMax", env: "KUMIKO_SLOW_MAX", def: "60s", value: durationValue{p: &c.HTTP.SlowMax},
			doc: "cap on GET /api/slow?ms=", old: "http.slowMaxSec"},
		{key: "http.demoEndpoints", env: "KUMIKO_DEMO_ENDPOINTS", def: "true", value: boolValue{p: &c.HTTP.DemoEndpoints},
			doc: "serve /api/slow; the k8s manifests turn it off"},
		{key: "http.trustedProxies", env: "KUMIKO_TRUSTED_PROXIES", value: prefixListValue{p: &c.HTTP.TrustedProxies},
			doc: "load balancers whose X-Forwarded-For names the client for the rate limit and the stream cap, exempt from the per-client connection bound; empty: the connection's own address"},

		{key: "ops.addr", env: "KUMIKO_OPS_ADDR", def: ":9090", value: addrValue{p: &c.OpsAddr},
			doc: "probes, metrics and admin routes; bound in phase 2, closed last"},
		{key: "admin.token", env: "KUMIKO_ADMIN_TOKEN", value: secretValue{p: &c.AdminToken, minLen: 16},
			doc: "bearer token of /admin/*; empty turns the admin routes off"},
		{key: "database.url", env: "DATABASE_URL", value: urlValue{p: &c.DatabaseURL, schemes: []string{"postgres", "postgresql"}},
			doc: "postgres://user:pass@host:5432/db", required: true},
		{key: "database.statementTimeout", env: "KUMIKO_DB_STATEMENT_TIMEOUT", def: "30s", value: durationValue{p: &c.DB.StatementTimeout},
			doc: "the server cancels any statement running longer (PostgreSQL statement_timeout)"},
		{key: "database.lockTimeout", env: "KUMIKO_DB_LOCK_TIMEOUT", def: "10s", value: durationValue{p: &c.DB.LockTimeout},
			doc: "a statement waiting this long for a lock fails (lock_timeout); migrations wait up to the phase timeout"},
		{key: "database.idleInTransactionTimeout", env: "KUMIKO_DB_IDLE_IN_TRANSACTION_TIMEOUT", def: "5s", value: durationValue{p: &c.DB.IdleInTransactionTimeout},
			doc: "the server ends a session that holds a transaction open this long between statements: a frozen or cut-off instance frees its locks (the scheduler's fence, a claimed delivery batch)"},
		{key: "secrets.masterKey", env: "KUMIKO_MASTER_KEY", value: secretValue{p: &c.MasterKey},
			doc: "base64 of 32 bytes (`head -c 32 /dev/urandom | base64`); set this or masterKeyFile"},
		{key: "secrets.masterKeyFile", env: "KUMIKO_MASTER_KEY_FILE", value: textValue{p: &c.MasterKeyFile},
			doc: "a mounted secret holding the base64 master key"},

		{key: "lifecycle.startupTimeout", env: "KUMIKO_STARTUP_TIMEOUT", def: "120s", value: durationValue{p: &l.StartupTimeout},
			doc: "the whole boot, from process start to ready", old: "lifecycle.startupTimeoutSec"},
		{key: "lifecycle.shutdownTimeout", env: "KUMIKO_SHUTDOWN_TIMEOUT", def: "40s", value: durationValue{p: &l.ShutdownTimeout},
			doc: "the whole drain, from the stop signal to exit; past it, exit 1", old: "lifecycle.shutdownTimeoutSec"},
		{key: "lifecycle.linger", env: "KUMIKO_LINGER", def: "3s", value: durationValue{p: &l.Linger, zeroOK: true},
			doc: "keep serving after readiness turns 503, so load balancers notice", old: "lifecycle.lingerSec"},
		{key: "lifecycle.lingerQuiet", env: "KUMIKO_LINGER_QUIET", def: "0", value: durationValue{p: &l.LingerQuiet, zeroOK: true},
			doc: "the linger ends once no request came for this long (after one readiness.probePeriod); 0: half the probe period; = linger: a fixed linger"},
		{key: "lifecycle.drainReject", env: "KUMIKO_DRAIN_REJECT", def: "refuse", value: choiceValue{p: &l.DrainReject, allowed: []string{"refuse", "retry-after"}},
			doc: "after the linger: refuse new connections, or keep the port open and answer 503 with Retry-After until the requests in flight are done"},
		{key: "lifecycle.drainTimeout", env: "KUMIKO_DRAIN_TIMEOUT", def: "30s", value: durationValue{p: &l.DrainTimeout},
			doc: "wait this long for in-flight requests", old: "lifecycle.drainTimeoutSec"},
		{key: "lifecycle.phaseTimeout", env: "KUMIKO_PHASE_TIMEOUT", def: "30s", value: durationValue{p: &l.PhaseTimeout},
			doc: "any one boot phase from 2 on, except the connect phases; the shutdown does not use it", old: "lifecycle.phaseTimeoutSec"},
		{key: "lifecycle.optionalDependencyTimeout", env: "KUMIKO_OPTIONAL_DEPENDENCY_TIMEOUT", def: "2s", value: durationValue{p: &l.OptionalDependencyTimeout},
			doc: "phases searchAdapter and fileStorage: a Meilisearch or S3 that does not answer within this holds the boot no longer; the phase warns and the boot goes on"},
		{key: "lifecycle.connectMaxWait", env: "KUMIKO_CONNECT_MAX_WAIT", def: "5m", value: durationValue{p: &l.ConnectMaxWait},
			doc: "retry window of dbConnect and redisConnect (the boot budget still wins)", old: "lifecycle.connectMaxWaitSec"},
		{key: "lifecycle.connectRetryBase", env: "KUMIKO_CONNECT_RETRY_BASE", def: "1s", value: durationValue{p: &l.ConnectRetryBase},
			doc: "first connect retry delay, doubling: 1, 2, 4, 8, 16, 30 s…", old: "lifecycle.connectRetryBaseSec"},
		{key: "lifecycle.connectRetryMax", env: "KUMIKO_CONNECT_RETRY_MAX", def: "30s", value: durationValue{p: &l.ConnectRetryMax},
			doc: "cap on one connect retry delay", old: "lifecycle.connectRetryMaxSec"},
		{key: "lifecycle.migrations.mode", env: "KUMIKO_MIGRATIONS_MODE", def: "exit-on-pending",
			value: choiceValue{p: &l.Migrations.Mode, allowed: []string{"exit-on-pending", "auto-apply", "warn-on-pending"}},
			doc:   "what phase 9 does with pending migrations"},
		{key: "lifecycle.migrations.schemaBaseline", env: "KUMIKO_SCHEMA_BASELINE", def: "0", value: uintValue{p: &l.Migrations.SchemaBaseline},
			doc: "oldest schema version this binary accepts; 0 turns phase 8 off"},
		{key: "lifecycle.readiness.probeTimeout", env: "KUMIKO_READINESS_PROBE_TIMEOUT", def: "1s", value: durationValue{p: &l.Readiness.ProbeTimeout},
			doc: "one run of one readiness check; a check that hangs longer counts as failed", old: "lifecycle.readiness.probeTimeoutSec"},
		{key: "lifecycle.readiness.probePeriod", env: "KUMIKO_READINESS_PROBE_PERIOD", def: "1s", value: durationValue{p: &l.Readiness.ProbePeriod},
			doc: "how long the load balancer takes to see a 503 (its check interval × failure threshold): the least a linger lasts"},
		{key: "lifecycle.readiness.checkInterval", env: "KUMIKO_READINESS_CHECK_INTERVAL", def: "1s", value: durationValue{p: &l.Readiness.CheckInterval},
			doc: "each readiness check runs in the background this often; /health/ready answers from the latest results at once", old: "lifecycle.readiness.cacheTtl"},

		{key: "diagnostics.dir", env: "KUMIKO_DIAGNOSTICS_DIR", value: textValue{p: &c.Diagnostics.Dir},
			doc: "where a drain or boot that went wrong writes the flight recorder's trace and a goroutine dump, newest 16 files kept; empty: " + serviceName + "-diagnostics in the temp dir. Kubernetes: an emptyDir (the root filesystem is read-only)"},
		{key: "diagnostics.flightRecorder", env: "KUMIKO_FLIGHT_RECORDER", def: "false", value: boolValue{p: &c.Diagnostics.FlightRecorder},
			doc: "keep the last seconds of the Go execution trace in memory for the whole life of the process (runtime/trace.FlightRecorder), written with the goroutine dump when something goes wrong; off by default because it costs about 8 % CPU per request (docs/measurements.md): turn it on where that is worth a trace of the next drain that goes wrong. The goroutine dumps and the termination message need no recorder"},
		{key: "diagnostics.flightRecorderWindow", env: "KUMIKO_FLIGHT_RECORDER_WINDOW", def: "10s", value: durationValue{p: &c.Diagnostics.RecorderWindow},
			doc: "the trace the recorder keeps, at least this far back, unless flightRecorderMaxMb is reached first"},
		{key: "diagnostics.flightRecorderMaxMb", env: "KUMIKO_FLIGHT_RECORDER_MAX_MB", def: "10", value: uintValue{p: &c.Diagnostics.RecorderMaxMB, min: 1, max: 1024},
			doc: "MiB of trace the recorder keeps at most (it wins over the window), plus the second being recorded; 10 s at the API's limit on a 2-core machine fit in less"},
		{key: "diagnostics.terminationLog", env: "KUMIKO_TERMINATION_LOG", value: textValue{p: &c.Diagnostics.TerminationLog},
			doc: "file that gets a one-paragraph summary when a drain or the boot went wrong, for kubectl describe pod; empty: /dev/termination-log where it exists, else none"},
	}
}

// defaultConfig is every setting at its default.
func defaultConfig() config {
	var c config
	for _, s := range c.settings() {
		if err := s.value.set(s.def); err != nil {
			// A typo in the table above; TestLoadConfigDefaults catches it.
			panic(fmt.Sprintf("config: the default of %s: %v", s.key, err))
		}
	}
	return c
}

// deprecatedKey is a former file key that was read in place of its new name.
type deprecatedKey struct {
	file string
	line int
	key  string // as written in the file
	use  string // its name now
}

// loadConfig builds the config from defaults, the optional file and the
// environment, and reports every problem it finds in one error, one per line.
// An empty environment variable counts as unset. The environment is read only
// through getenv and environ (its "NAME=value" lines, for the names it
// holds), files only through readFile (os.ReadFile in production), so tests
// can pass fakes.
func loadConfig(getenv func(string) string, environ []string, readFile func(string) ([]byte, error)) (config, error) {
	c := defaultConfig()
	fileName, fromFile, problems := readConfigFile(getenv, readFile)

	for _, s := range c.settings() {
		key := s.key
		v, inFile := fromFile[s.key]
		if oldV, inFileOld := fromFile[s.old]; s.old != "" && inFileOld {
			if inFile {
				problems = append(problems, fmt.Errorf("%s: line %d: %s is the former name of %s, which line %d sets too; keep only %s",
					fileName, oldV.line, s.old, s.key, v.line, s.key))
			} else {
				key, v, inFile = s.old, oldV, true
				c.deprecated = append(c.deprecated, deprecatedKey{file: fileName, line: v.line, key: s.old, use: s.key})
			}
		}
		if inFile {
			if err := s.value.set(v.raw); err != nil {
				problems = append(problems, fmt.Errorf("%s: line %d: %s: %w", fileName, v.line, key, err))
			}
		}
		if raw := getenv(s.env); raw != "" {
			if err := s.value.set(raw); err != nil {
				problems = append(problems, fmt.Errorf("%s: %w", s.env, err))
			}
		}
		// Every string value logs as a string, "" when unset.
		if s.required && s.value.logValue() == "" {
			problems = append(problems, fmt.Errorf("%s is required (%s in the config file)", s.env, s.key))
		}
	}
	if c.InstanceID == "" {
		c.InstanceID = defaultInstanceID(getenv)
	}
	// A misspelt variable would otherwise do nothing, silently: refused like
	// an unknown file key, unless the operator chose to share the prefix.
	for _, u := range unknownEnvVars(environ, c.settings()) {
		if c.UnknownEnv == "warn" {
			c.unknownEnv = append(c.unknownEnv, u)
			continue
		}
		problems = append(problems, fmt.Errorf("%s is set, but no setting reads it (the closest is %s); "+
			"KUMIKO_UNKNOWN_ENV=warn boots anyway, where other tools share the %s prefix", u.name, u.closest, envPrefix))
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

// validate checks the rules that span several settings; the rules of one
// setting are in its value, in the table.
func (c *config) validate() []error {
	l := c.Lifecycle
	// Port 0 asks the kernel for a free port, so two ":0" listeners never collide.
	httpPort, opsPort := portOf(c.HTTPAddr), portOf(c.OpsAddr)
	return slices.Concat(
		rule(httpPort != opsPort || httpPort == "0" || httpPort == "",
			"http.addr (%s) and ops.addr (%s) must use different ports", c.HTTPAddr, c.OpsAddr),
		rule(c.MasterKey == "" || c.MasterKeyFile == "",
			"secrets.masterKey and secrets.masterKeyFile (KUMIKO_MASTER_KEY, KUMIKO_MASTER_KEY_FILE) are both set; set only one"),
		rule(l.DrainTimeout+l.Linger < l.ShutdownTimeout,
			"lifecycle.shutdownTimeout (%s) must be longer than drainTimeout + linger (%s + %s): "+
				"the rest of the shutdown, stopping workers and closing connections, needs time after the drain",
			l.ShutdownTimeout, l.DrainTimeout, l.Linger),
		rule(l.ConnectRetryBase <= l.ConnectRetryMax,
			"lifecycle.connectRetryBase (%s) must not exceed connectRetryMax (%s), the cap on a single delay",
			l.ConnectRetryBase, l.ConnectRetryMax),
		rule(c.HTTP.RateLimit == 0 || c.HTTP.RateBurst >= 1, "http.rateBurst must be at least 1 when http.rateLimit is set"),
		rule(c.HTTP.ConcurrencyMax == 0 || c.HTTP.ConcurrencyMin <= c.HTTP.ConcurrencyMax,
			"http.concurrencyMin (%d) must not exceed concurrencyMax (%d)", c.HTTP.ConcurrencyMin, c.HTTP.ConcurrencyMax),
		c.blockConfig.validate(c),
	)
}

// rule is a rule that spans several settings: no problem when ok, else one.
func rule(ok bool, format string, args ...any) []error {
	if ok {
		return nil
	}
	return []error{fmt.Errorf(format, args...)}
}

// portOf returns the port of a host:port address, or "" if it has none.
func portOf(addr string) string {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return ""
	}
	return port
}

// configLogGroup is one line of the startup log's config: a section of the
// file and its settings, keyed like the file, secrets masked.
type configLogGroup struct {
	name   string
	fields map[string]any
}

// logGroups returns the whole config as a few readable log lines, one per
// section of the file (a key up to its last dot: "http",
// "lifecycle.readiness"), in the order of settings(). The settings alone in
// their section (instanceId, log.format, ops.addr, …) share the first line,
// "general". Secrets are masked.
func (c config) logGroups() []configLogGroup {
	section := func(key string) string {
		if i := strings.LastIndexByte(key, '.'); i >= 0 {
			return key[:i]
		}
		return key
	}
	settings := c.settings()
	size := map[string]int{}
	for _, s := range settings {
		size[section(s.key)]++
	}
	groups := []configLogGroup{{name: "general", fields: map[string]any{}}}
	index := map[string]int{"general": 0}
	for _, s := range settings {
		name := section(s.key)
		if size[name] == 1 {
			name = "general"
		}
		i, ok := index[name]
		if !ok {
			i = len(groups)
			index[name] = i
			groups = append(groups, configLogGroup{name: name, fields: map[string]any{}})
		}
		groups[i].fields[s.key] = s.value.logValue()
	}
	return groups
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
// messages, the values it sets keyed by dotted path as written
// ("lifecycle.linger"), and every problem found in it. The settings table is
// the schema: a key it does not name (by its name or its former name) is an
// error, so a misspelt key never silently does nothing.
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
	var keys []string // the current names, for a hint
	var c config
	for _, s := range c.settings() {
		keys = append(keys, s.key)
		for _, key := range []string{s.key, s.old} {
			if key == "" {
				continue
			}
			leaves[key] = true
			for path := key; strings.Contains(path, "."); {
				path = path[:strings.LastIndex(path, ".")]
				sections[path] = true
			}
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
				problems = append(problems, fmt.Errorf("%s: line %d: unknown key %s (the closest is %s)", name, key.Line, path, closestName(path, keys)))
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

// Unknown environment variables.

// unknownVar is a KUMIKO_ variable that was set and that no setting reads,
// with the name of the setting that is spelt most like it.
type unknownVar struct{ name, closest string }

// toolingEnv is the KUMIKO_ variables the project's tests and scripts read,
// not the service: a shell or CI job that exports them (.ci/run exports
// KUMIKO_REQUIRE_SERVICES) still starts the service. TestEnvNamesInTheTree
// keeps the list complete.
func toolingEnv() []string {
	return []string{"KUMIKO_BIN", "KUMIKO_FUZZTIME", "KUMIKO_K8S_CACHE", "KUMIKO_K8S_SMOKE", "KUMIKO_REGENERATE", "KUMIKO_REQUIRE_SERVICES",
		// demo:begin (the orders demo's tests read these; scripts/new-service.sh --bare removes this block)
		"KUMIKO_BENCH_BINARY", "KUMIKO_FLEET_FAULT", "KUMIKO_SCREENSHOT", "KUMIKO_TEST_REDIS_OUTAGE",
		"KUMIKO_BENCH_PAIRS", "KUMIKO_BENCH_SECONDS", "KUMIKO_BENCH_TOGETHER", "KUMIKO_BENCH_WORKERS",
		// demo:end
	}
}

// unknownEnvVars is every non-empty variable in environ under envPrefix that
// neither a setting, KUMIKO_CONFIG nor the tooling reads, in environ's order.
func unknownEnvVars(environ []string, settings []configSetting) []unknownVar {
	known := []string{"KUMIKO_CONFIG"}
	for _, s := range settings {
		if strings.HasPrefix(s.env, envPrefix) {
			known = append(known, s.env)
		}
	}
	var unknown []unknownVar
	for _, kv := range environ {
		name, value, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, envPrefix) && value != "" && !slices.Contains(known, name) && !slices.Contains(toolingEnv(), name) {
			unknown = append(unknown, unknownVar{name: name, closest: closestName(name, known)})
		}
	}
	return unknown
}

// closestName is the name in names nearest to name by edit distance, for a
// "did you mean" hint; a tie goes to the earlier name.
func closestName(name string, names []string) string {
	best, bestDistance := "", -1
	for _, n := range names {
		if d := editDistance(name, n); bestDistance < 0 || d < bestDistance {
			best, bestDistance = n, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b: the fewest inserted,
// deleted or replaced bytes that turn one into the other.
func editDistance(a, b string) int {
	prev, cur := make([]int, len(b)+1), make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			replace := prev[j-1]
			if a[i-1] != b[j-1] {
				replace++
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, replace)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
