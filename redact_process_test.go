package main

import (
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Secrets in URLs — a userinfo and token-like query parameters — show
// nowhere: not in the config log line, the search phase's warning, the ops
// readiness body or /admin/lifecycle (issue 20 found the MEILI_URL userinfo
// in /admin/lifecycle and a ?token= in all of them).
func TestProcessSecretsInURLsAreRedactedEverywhere(t *testing.T) {
	env := fastEnv(t,
		"KUMIKO_ADMIN_TOKEN="+testAdminToken,
		// Nothing listens on port 1: search degrades, and its error and note show.
		"MEILI_URL=http://ada:pw-in-userinfo-42@127.0.0.1:1/?token=tok-in-query-42&api_key=key-in-query-42",
	)
	p := startProc(t, env)
	ops, _ := p.waitReady()
	// Its phase line: a warning where a feature uses search, skipped where none does.
	p.waitLog(5*time.Second, map[string]any{"msg": "lifecycle", "phase": "searchAdapter"})
	shown := map[string]string{}
	for _, path := range []string{"/health/ready", "/admin/lifecycle", "/admin/workers"} {
		_, raw := getBody(t, ops+path, "Bearer "+testAdminToken)
		shown["ops "+path] = string(raw)
	}
	// The whole log, the drain's included.
	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	shown["logs"] = p.logText() + p.stderr.String()
	for where, text := range shown {
		for _, secret := range []string{"pw-in-userinfo-42", "tok-in-query-42", "key-in-query-42"} {
			if strings.Contains(text, secret) {
				i := strings.Index(text, secret)
				t.Errorf("%s shows %s: …%s…", where, secret, text[max(0, i-200):min(len(text), i+60)])
			}
		}
	}
	if !strings.Contains(shown["logs"], "xxxxx") {
		t.Error("the config log line shows no redacted URL at all")
	}
}

// What redactConnString shows of a URL, and which secrets the log's redact
// hook scrubs wherever they turn up.
func TestRedactConnStringHidesUserinfoAndTokenParams(t *testing.T) {
	for _, tc := range []struct{ in, shown, secrets string }{
		{"https://ada:pw@meili:7700/", "https://ada:xxxxx@meili:7700/", "pw"},
		{"https://tok123@meili:7700/", "https://xxxxx@meili:7700/", "tok123"},
		{"http://meili/?token=t1&key=k1&secret=s1&password=p1&api_key=a1&sig=g1&index=movies",
			"http://meili/?api_key=xxxxx&index=movies&key=xxxxx&password=xxxxx&secret=xxxxx&sig=xxxxx&token=xxxxx", "a1 g1 k1 p1 s1 t1"},
		{"postgres://kumiko@db/kumiko?sslmode=disable", "postgres://kumiko@db/kumiko?sslmode=disable", ""}, // a role name, not a token
		{"postgres://kumiko:pw@db/kumiko", "postgres://kumiko:xxxxx@db/kumiko", "pw"},
	} {
		secrets := connPasswords(tc.in)
		slices.Sort(secrets)
		if got := redactConnString(tc.in); got != tc.shown || strings.Join(secrets, " ") != tc.secrets {
			t.Errorf("%s: shown %s, secrets %q; want %s, %q", tc.in, got, secrets, tc.shown, tc.secrets)
		}
	}
}
