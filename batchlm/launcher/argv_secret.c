/*
 * Preloaded into tritonserver (LD_PRELOAD) by batchlm/launcher/argv_secret.py: it puts a secret into the
 * arguments main() parses without the secret ever being on the process's command line, which every
 * local user can read in /proc/<pid>/cmdline.
 *
 * The secret comes in the environment variable BATCHLM_ARGV_SECRET, and the placeholder that stands
 * for it on the command line (random for each server) in BATCHLM_ARGV_PLACEHOLDER; /proc/<pid>/environ
 * is readable by the process's own user only. Before main() runs, each argument that holds the
 * placeholder is replaced, in the argument vector main() receives, by a copy with the secret in its
 * place; the command line keeps the placeholder. Then the secret is overwritten where the kernel shows
 * the environment from (the caller checks that it was, to know that this ran), both variables are
 * removed, and this library is taken off LD_PRELOAD (the first entry, where argv_secret.py puts it), so
 * that the processes tritonserver starts (the Python backend stubs) inherit none of it; other
 * preloaded libraries stay.
 *
 * glibc calls a shared object's constructors with (argc, argv, envp), and argv is the vector that
 * main() is then called with.
 */
#define _DEFAULT_SOURCE
#include <stdlib.h>
#include <string.h>

#define SECRET "BATCHLM_ARGV_SECRET"
#define PLACEHOLDER "BATCHLM_ARGV_PLACEHOLDER"

static char *copy_or_die(const char *text) {
    char *copy = strdup(text);
    if (copy == NULL) abort();
    return copy;
}

static char *with_secret(const char *arg, const char *at, size_t placeholder_len, const char *secret) {
    size_t head = (size_t)(at - arg), secret_len = strlen(secret);
    const char *tail = at + placeholder_len;
    char *out = malloc(head + secret_len + strlen(tail) + 1);
    if (out == NULL) abort();
    memcpy(out, arg, head);
    memcpy(out + head, secret, secret_len);
    strcpy(out + head + secret_len, tail);
    return out;
}

static void blank_value(char **envp, const char *name) {
    size_t name_len = strlen(name);
    for (char **entry = envp; *entry != NULL; entry++) {
        if (strncmp(*entry, name, name_len) == 0 && (*entry)[name_len] == '=') {
            memset(*entry + name_len + 1, 'x', strlen(*entry + name_len + 1));
        }
    }
}

static void drop_first_preload(void) {
    const char *preload = getenv("LD_PRELOAD");
    if (preload == NULL) return;
    size_t first = strcspn(preload, ": ");
    if (preload[first] == '\0') {
        unsetenv("LD_PRELOAD");
        return;
    }
    char *rest = copy_or_die(preload + first + 1);
    setenv("LD_PRELOAD", rest, 1);
    free(rest);
}

__attribute__((constructor)) static void put_secret(int argc, char **argv, char **envp) {
    const char *found_secret = getenv(SECRET), *found_placeholder = getenv(PLACEHOLDER);
    if (found_secret == NULL || found_placeholder == NULL || found_placeholder[0] == '\0') return;
    char *secret = copy_or_die(found_secret), *placeholder = copy_or_die(found_placeholder);
    size_t placeholder_len = strlen(placeholder);
    for (int i = 0; i < argc; i++) {
        const char *at = strstr(argv[i], placeholder);
        if (at != NULL) argv[i] = with_secret(argv[i], at, placeholder_len, secret);
    }
    blank_value(envp, SECRET);
    unsetenv(SECRET);
    unsetenv(PLACEHOLDER);
    drop_first_preload();
    explicit_bzero(secret, strlen(secret));
    free(secret);
    free(placeholder);
}
