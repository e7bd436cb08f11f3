package main

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/sirupsen/logrus"
)

// No secret is ever shown: what the log, the phase notes, /admin/lifecycle and
// the readiness bodies print goes through one of the scrubbers below.

// redactedMark stands in for a secret in the startup log.
const redactedMark = "[redacted]"

// redactConnString returns a connection URL that is safe to show (the
// config log line, phase notes, /admin/lifecycle, readiness bodies): the
// password of its userinfo, an HTTP userinfo that is a user alone (then it is
// a token, as in https://<token>@host) and every token-like query parameter
// (secretQueryParam) become xxxxx. A user with a password is shown: it is a
// name, not a secret.
func redactConnString(s string) string {
	if s == "" {
		return ""
	}
	u, err := url.Parse(s)
	if err != nil {
		return redactedMark // no telling where a password might be
	}
	if loneUserIsToken(u) {
		u.User = url.User("xxxxx")
	}
	if q := u.Query(); u.RawQuery != "" {
		redacted := false
		for name := range q {
			if secretQueryParam(name) {
				q[name] = []string{"xxxxx"}
				redacted = true
			}
		}
		if redacted {
			u.RawQuery = q.Encode()
		}
	}
	return u.Redacted()
}

// loneUserIsToken reports an HTTP URL whose userinfo is a user without a
// password: such a user is an API token (https://<token>@host). A database
// URL's lone user is a role name.
func loneUserIsToken(u *url.URL) bool {
	if u.User == nil || u.User.Username() == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return false
	}
	_, hasPassword := u.User.Password()
	return !hasPassword
}

// secretQueryParam reports a query parameter that carries a credential:
// Postgres drivers take the password as one, and services take API keys,
// tokens and signatures as ?key=, ?token=, ?api_key=, ?access_token=,
// ?secret=, ?sig= and the like.
func secretQueryParam(name string) bool {
	name = strings.ToLower(name)
	for _, part := range []string{"pass", "pwd", "token", "key", "secret", "sig", "auth", "credential"} {
		if strings.Contains(name, part) {
			return true
		}
	}
	return false
}

// connPasswords returns the secrets in a connection URL: the userinfo's
// password (or the user alone, which is then a token) and the values of
// token-like query parameters, for the log's redact hook to scrub wherever
// they turn up (a driver's error text repeats its URL).
func connPasswords(s string) []string {
	u, err := url.Parse(s)
	if err != nil {
		return nil
	}
	var passwords []string
	// A value is scrubbed as given and as it appears inside a URL.
	add := func(v string) {
		passwords = append(passwords, v)
		if esc := url.QueryEscape(v); esc != v {
			passwords = append(passwords, esc)
		}
	}
	if pw, ok := u.User.Password(); ok && pw != "" {
		add(pw)
	} else if loneUserIsToken(u) {
		passwords = append(passwords, u.User.Username())
	}
	for name, values := range u.Query() {
		if !secretQueryParam(name) {
			continue
		}
		for _, v := range values {
			if v != "" {
				add(v)
			}
		}
	}
	return passwords
}

// redactHook scrubs every configured secret from every log line, whatever field
// or error text it hides in: a driver error that echoes a connection string must
// not leak its password.
type redactHook struct{ secrets []string }

func (h redactHook) Levels() []logrus.Level { return logrus.AllLevels }

func (h redactHook) Fire(e *logrus.Entry) error {
	e.Message = h.redact(e.Message)
	for k, v := range e.Data {
		switch v := v.(type) {
		case string:
			e.Data[k] = h.redact(v)
		case error:
			e.Data[k] = h.redact(v.Error())
		case fmt.Stringer:
			e.Data[k] = h.redact(v.String())
		}
	}
	return nil
}

func (h redactHook) redact(s string) string {
	for _, secret := range h.secrets {
		if secret != "" {
			s = strings.ReplaceAll(s, secret, "[redacted]")
		}
	}
	return s
}

// err is err with every secret scrubbed from its text; errors.Is and As
// still see the original.
func (h redactHook) err(err error) error {
	if err == nil {
		return nil
	}
	if text := h.redact(err.Error()); text != err.Error() {
		return scrubbedError{text: text, err: err}
	}
	return err
}

type scrubbedError struct {
	text string
	err  error
}

// redactURL shows an endpoint without its credentials: the userinfo and the
// query (where tokens also travel) are replaced by a mark. What is not a URL
// is shown as the mark alone.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return redactedMark
	}
	if u.User != nil {
		u.User = url.User("REDACTED")
	}
	if u.RawQuery != "" {
		u.RawQuery = "REDACTED"
	}
	return u.String()
}

func (e scrubbedError) Error() string { return e.text }

func (e scrubbedError) Unwrap() error { return e.err }

// ---------------------------------------------------------------------------
// Metrics
